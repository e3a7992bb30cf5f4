"""TOML presets: a `SimConfig` with its models, by name (`sim_app/presets/NAME.toml`) or path.

Layout (every section optional; keys are the dataclass fields):

```toml
description = "one line"
[run]          # SimConfig: mode, steps, batch_size, replicas, max_staleness, pacing, ...
[decode]       # DecodeModel
[trainer]      # TrainerModel
[lengths]      # LengthModel (histogram / cap_schedule as lists of [x, y] pairs)
[contention]   # Contention
[measured]     # what a calibrated preset was fitted to: steps, sync_wall_s, async_wall_s
```

`--set KEY=VALUE` overrides a field: `max_staleness=4`, `decode.iteration_s=0.01`,
`lengths.max_tokens=28672` (the value is parsed as TOML, so `pacing="eager"` or `pacing=eager`).
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sim_app.models import Contention, DecodeModel, LengthModel, TrainerModel, from_mapping
from sim_app.pipeline import SimConfig

__all__ = [
    "PRESETS_DIR",
    "Preset",
    "apply_overrides",
    "config_from_toml",
    "config_to_toml",
    "list_presets",
    "load_preset",
]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
_SECTIONS: dict[str, type[Any]] = {
    "decode": DecodeModel,
    "trainer": TrainerModel,
    "lengths": LengthModel,
    "contention": Contention,
}


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: SimConfig
    measured: dict[str, Any] = field(default_factory=dict)


def list_presets() -> dict[str, str]:
    """Preset name -> description."""
    out = {}
    for path in sorted(PRESETS_DIR.glob("*.toml")):
        out[path.stem] = str(tomllib.loads(path.read_text()).get("description", ""))
    return out


def load_preset(name_or_path: str | Path, overrides: Sequence[str] = ()) -> Preset:
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESETS_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise FileNotFoundError(
            f"no preset {name_or_path!r}; built-in: {', '.join(list_presets())}, or a .toml path"
        )
    data = tomllib.loads(path.read_text())
    config = apply_overrides(config_from_toml(data, source=str(path)), overrides)
    return Preset(
        name=path.stem,
        description=str(data.get("description", "")),
        config=config,
        measured=dict(data.get("measured", {})),
    )


def config_from_toml(data: dict[str, Any], source: str = "") -> SimConfig:
    known = {"description", "run", "measured", *_SECTIONS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown preset section(s) {unknown}; known: {sorted(known)}")
    models = {name: from_mapping(cls, data.get(name, {})) for name, cls in _SECTIONS.items()}
    run = dict(data.get("run", {}))
    run.setdefault("source", source)
    return from_mapping(SimConfig, {**run, **models})  # type: ignore[no-any-return]


def apply_overrides(config: SimConfig, overrides: Sequence[str]) -> SimConfig:
    """Apply `KEY=VALUE` settings (see the module docstring)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        value = _parse_value(text.strip())
        section, _, name = key.strip().rpartition(".")
        if section:
            if section not in _SECTIONS:
                raise ValueError(f"--set {item!r}: unknown section {section!r}")
            model = getattr(config, section)
            config = replace(
                config, **{section: from_mapping(_SECTIONS[section], {name: value}, model)}
            )
        else:
            config = from_mapping(SimConfig, {name: value}, config)
    return config


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def config_to_toml(
    config: SimConfig, description: str = "", measured: dict[str, Any] | None = None
) -> str:
    """The preset file for `config` (what `load_preset` reads back)."""
    lines = [f"description = {_toml(description)}", "", "[run]"]
    for f in fields(SimConfig):
        value = getattr(config, f.name)
        if f.name in _SECTIONS or value is None:
            continue
        lines.append(f"{f.name} = {_toml(value)}")
    for name, cls in _SECTIONS.items():
        model = getattr(config, name)
        lines += ["", f"[{name}]"]
        for f in fields(cls):
            if f.init:
                lines.append(f"{f.name} = {_toml(getattr(model, f.name))}")
    if measured:
        lines += ["", "[measured]"]
        lines += [f"{key} = {_toml(value)}" for key, value in measured.items()]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
