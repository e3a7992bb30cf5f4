"""What a run needs to know about a local model before anything starts: its context length,
its EOS and pad token ids, and whether vLLM can load its architecture.

All of it is read from the checkpoint's files (config.json, generation_config.json, the
tokenizer); vLLM's model registry is read from vLLM's source without importing vLLM, which
takes tens of seconds and would initialise torch in the driver.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_POSITIONS",
    "ModelFacts",
    "UnsupportedModel",
    "check_vllm_architectures",
    "load_tokenizer",
    "read_model_facts",
    "vllm_architectures",
]

# Context length assumed when config.json names none (vLLM's own fallback is the same order).
DEFAULT_MAX_POSITIONS = 2048
# vLLM's registry module and the dict that unions every architecture it can load.
VLLM_REGISTRY_FILE = Path("model_executor") / "models" / "registry.py"
VLLM_REGISTRY_DICT = "_VLLM_MODELS"


class UnsupportedModel(ValueError):
    """The model at `--model` cannot be served by vLLM (or has no usable config)."""


@dataclass(frozen=True)
class ModelFacts:
    """A local checkpoint's facts. `eos_token_ids`: the tokenizer's EOS and every id the
    generation config lists (chat models often stop on several); `pad_token_id`: the
    tokenizer's pad, else the generation config's, else the first EOS id, else 0."""

    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    architectures: tuple[str, ...]


def load_tokenizer(model_dir: Path | str) -> Any:
    """The tokenizer of `model_dir`: `AutoTokenizer`'s, except a word-level one (the tiny
    model's character tokenizer), loaded from its tokenizer.json as saved. For some model
    types (qwen2 among them) transformers rebuilds the tokenizer as the model family's
    byte-level BPE around the saved vocabulary, which drops spaces and line breaks the
    character tokenizer has tokens for."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    saved = _read_json(Path(model_dir) / "tokenizer.json")
    if saved.get("model", {}).get("type") == "WordLevel":
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


def read_model_facts(model_dir: Path | str) -> ModelFacts:
    """Read `model_dir`'s config.json, generation_config.json (optional) and tokenizer."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise UnsupportedModel(f"--model {model_dir}: no config.json (not a HF checkpoint)")
    config = json.loads(config_path.read_text())
    text_config = config.get("text_config", config)
    generation = _read_json(model_dir / "generation_config.json")
    tokenizer = load_tokenizer(model_dir)
    eos = _unique(_ids(tokenizer.eos_token_id), _ids(generation.get("eos_token_id")))
    if not eos:
        eos = _ids(text_config.get("eos_token_id"))
    pad_candidates = [tokenizer.pad_token_id, generation.get("pad_token_id"), *eos, 0]
    return ModelFacts(
        max_position_embeddings=int(
            text_config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)
        ),
        eos_token_ids=eos,
        pad_token_id=next(int(p) for p in pad_candidates if p is not None),
        architectures=tuple(config.get("architectures") or ()),
    )


def check_vllm_architectures(model_dir: Path | str, architectures: Iterable[str]) -> None:
    """Raise `UnsupportedModel` (one line) unless vLLM can load one of `architectures`.

    An architecture missing from vLLM's registry may still load through vLLM's Transformers
    backend when transformers' class supports it (`_supports_attention_backend`), so that is
    accepted too. Nothing is checked when the registry cannot be read (vLLM's layout
    changed): the engine's own error then comes at its start."""
    architectures = tuple(architectures)
    known = vllm_architectures()
    if known is None:
        logger.warning("could not read vLLM's model registry; not checking %s", architectures)
        return
    if not architectures:
        raise UnsupportedModel(f"--model {model_dir}: config.json names no `architectures`")
    if any(a in known or _transformers_backend_can_load(a) for a in architectures):
        return
    raise UnsupportedModel(
        f"--model {model_dir}: vLLM cannot load architecture {', '.join(architectures)} "
        f"(not in its registry of {len(known)} architectures, nor loadable through its "
        "Transformers backend)"
    )


@functools.cache
def vllm_architectures() -> frozenset[str] | None:
    """Every architecture name in the installed vLLM's registry, read from its source (no
    import of vLLM); None if vLLM is not installed or its registry cannot be parsed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / VLLM_REGISTRY_FILE
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    dicts = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    names = _dict_keys(dicts, VLLM_REGISTRY_DICT)
    return frozenset(names) if names else None


def _dict_keys(dicts: dict[str, ast.Dict], name: str) -> set[str]:
    """String keys of the dict literal `name`, following `**OTHER` entries."""
    keys: set[str] = set()
    node = dicts.get(name)
    for key, value in zip(node.keys, node.values, strict=True) if node else ():
        if key is None and isinstance(value, ast.Name):
            keys |= _dict_keys(dicts, value.id)
        elif isinstance(key, ast.Constant) and isinstance(key.value, str):
            keys.add(key.value)
    return keys


def _transformers_backend_can_load(architecture: str) -> bool:
    import transformers

    try:
        model_class = getattr(transformers, architecture, None)
    except Exception:  # a lazy transformers attribute whose import fails
        return False
    return bool(getattr(model_class, "_supports_attention_backend", False))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def _unique(*groups: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for group in groups for i in group))
