"""Every knob of a run is visible: each field of every configuration object in a `RunPlan`
is set in `train_app.plan` from a documented `TrainConfig` field, a named constant of
`plan.py` with a comment saying why, or what the caller passes in (the model's facts, the
resume point, the machine). A knob left to a package's default, or set from a bare literal,
fails here.

The walk starts at a real plan (`plan(TrainConfig())`) and collects every dataclass it
reaches; the resume point (`RunPlan.resume`, `ReplicaPlan.restore`) is skipped: it is read
from a checkpoint, not chosen."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import train_app.actors
import train_app.config
import train_app.plan
from train_app.config import TrainConfig
from train_app.plan import plan

# Fields holding what a checkpoint says (read from the disk, not chosen by anyone).
FROM_THE_CHECKPOINT = {"resume", "restore"}


def _reached(obj: Any, seen: dict[str, type]) -> None:
    """Every dataclass type reachable from `obj`'s field values (tuples included)."""
    if isinstance(obj, tuple | list):
        for item in obj:
            _reached(item, seen)
        return
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    seen[type(obj).__name__] = type(obj)
    for f in dataclasses.fields(obj):
        if f.name not in FROM_THE_CHECKPOINT:
            _reached(getattr(obj, f.name), seen)


def _documented_train_config_names() -> set[str]:
    """TrainConfig fields with a docstring, and its properties (derived from fields)."""
    tree = ast.parse(inspect.getsource(train_app.config))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    names = set()
    for node, after in zip(cls.body, [*cls.body[1:], None], strict=True):
        documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and documented:
            names.add(node.target.id)  # type: ignore[union-attr]
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list
        ):
            names.add(node.name)
    return names


def _commented_constants(source: str) -> set[str]:
    """Module-level UPPER_CASE names assigned in a block that a comment opens."""
    lines = source.splitlines()
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if not name.isupper():
                continue
            row = node.lineno - 2  # the line above, 0-based
            while row >= 0 and lines[row].strip() and not lines[row].lstrip().startswith("#"):
                row -= 1  # inside a block of constants: look for the block's comment
            if row >= 0 and lines[row].lstrip().startswith("#"):
                names.add(name)
    return names


PLAN_SOURCE = Path(train_app.plan.__file__).read_text()
DOCUMENTED = _documented_train_config_names()
CONSTANTS = _commented_constants(PLAN_SOURCE)


def _unaccounted(value: ast.expr, local_names: set[str]) -> list[str]:
    """The parts of a keyword's value that are neither a documented TrainConfig field, a
    commented constant, nor a value the plan computes or is given (`local_names`)."""
    bad = []
    path_parts = {  # `run_dir / "logs"`: a file's name in the run dir, not a knob
        id(n.right)
        for n in ast.walk(value)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
    }
    for node in ast.walk(value):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "config" and node.attr not in DOCUMENTED:
                bad.append(f"config.{node.attr} (not a documented TrainConfig field)")
        elif isinstance(node, ast.Name) and node.id.isupper() and node.id not in CONSTANTS:
            bad.append(f"{node.id} (a constant without a comment)")
        elif isinstance(node, ast.Constant) and node.value is not None:
            bad += [] if id(node) in path_parts else [f"literal {node.value!r}"]
    return bad


def _settings() -> dict[tuple[str, str], list[str]]:
    """(class, field) -> problems, for every keyword that plan.py passes to a class's
    constructor or to `replace`."""
    tree = ast.parse(PLAN_SOURCE)
    settings: dict[tuple[str, str], list[str]] = {}
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        local_names = {a.arg for a in func.args.args + func.args.kwonlyargs}
        for call in ast.walk(func):
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                continue
            owner = call.func.id
            if owner == "replace" and call.args:
                owner = "TrainerPlan"  # the one `replace` of plan.py: per-rank trainer plans
            for keyword in call.keywords:
                if keyword.arg is not None:
                    problems = _unaccounted(keyword.value, local_names)
                    settings[(owner, keyword.arg)] = problems
    return settings


def test_every_field_of_the_plan_is_a_flag_a_named_constant_or_an_input() -> None:
    seen: dict[str, type] = {}
    _reached(plan(TrainConfig()), seen)
    assert {"RunPlan", "ReplicaPlan", "TrainerPlan", "PPOConfig", "RolloutConfig"} <= set(seen)
    assert {"SamplingConfig", "VLLMEngineConfig"} <= set(seen)
    settings = _settings()
    missing, bad = [], []
    for name, cls in seen.items():
        if name == "StalenessBound":
            continue  # built once, from --max-staleness (`staleness_bound`)
        for f in dataclasses.fields(cls):
            if (name, f.name) not in settings:
                missing.append(f"{name}.{f.name}")
            elif settings[(name, f.name)]:
                bad.append(f"{name}.{f.name}: {settings[(name, f.name)]}")
    assert not missing, f"left to a package default, set nowhere in plan.py: {missing}"
    assert not bad, f"set from something that is neither a flag nor a named constant: {bad}"


@pytest.mark.parametrize("constant", sorted(CONSTANTS))
def test_named_constants_are_module_level_and_importable(constant: str) -> None:
    assert hasattr(train_app.plan, constant)


def test_the_checker_catches_an_unnamed_knob() -> None:
    """The checker itself: a literal, an undocumented attribute and an uncommented
    constant are caught; a flag, a commented constant and an input pass."""
    expression = ast.parse("0.25 + config.nope + UNDOCUMENTED + 'x' / a", mode="eval").body
    assert len(_unaccounted(expression, set())) == 4
    fine = ast.parse("config.lr * PACING_MARGIN + share", mode="eval").body
    assert _unaccounted(fine, {"share"}) == []


def test_actor_concurrency_is_a_named_constant() -> None:
    source = Path(train_app.actors.__file__).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "max_concurrency":
            assert isinstance(node.value, ast.Name) and node.value.id in CONSTANTS
