"""Design rules 1 and 3: packages never import each other, and imports stay light."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "async_queue": ROOT / "packages/async-queue/src/async_queue",
    "mm_preprocess": ROOT / "packages/mm-preprocess/src/mm_preprocess",
    "rollout_engine": ROOT / "packages/rollout-engine/src/rollout_engine",
    "ppo_trainer": ROOT / "packages/ppo-trainer/src/ppo_trainer",
    "tiny_models": ROOT / "packages/tiny-models/src/tiny_models",
}


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_package_does_not_import_a_sibling(package: str) -> None:
    siblings = set(PACKAGES) - {package}
    offenders = {
        str(f.relative_to(ROOT)): sorted(_imported_roots(f) & siblings)
        for f in PACKAGES[package].rglob("*.py")
        if _imported_roots(f) & siblings
    }
    assert not offenders


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("async_queue", ["torch", "vllm", "transformers"]),
        ("mm_preprocess", ["torch", "vllm", "qwen_vl_utils", "transformers"]),
        ("rollout_engine", ["torch", "vllm", "transformers", "ray"]),
        ("ppo_trainer", ["vllm", "ray"]),
    ],
)
def test_import_is_light(package: str, forbidden: list[str]) -> None:
    code = (
        f"import sys, {package}\n"
        f"heavy = [m for m in {forbidden!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_package_is_typed_and_declares_its_api(package: str) -> None:
    assert (PACKAGES[package] / "py.typed").exists()
    module = __import__(package)
    assert module.__all__, f"{package} has an empty __all__"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing


def _requirement_names(requirements: list[str]) -> set[str]:
    """The distribution names of PEP 508 requirement strings, normalised."""
    names = set()
    for requirement in requirements:
        name = re.split(r"[\s\[<>=!~;@(]", requirement.strip(), maxsplit=1)[0]
        names.add(re.sub(r"[-_.]+", "-", name).lower())
    return names


@pytest.mark.parametrize(
    "project",
    sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
    + sorted(f"apps/{p.parent.name}" for p in ROOT.glob("apps/*/pyproject.toml")),
)
def test_verl_is_never_a_runtime_dependency(project: str) -> None:
    """verl is only a test-only dependency (the workspace's dev group): no package or app
    requires it, in its dependencies or extras, and no package's code imports it."""
    directory = ROOT / project if project.startswith("apps/") else ROOT / "packages" / project
    meta = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
    requirements = list(meta.get("dependencies", []))
    for extra in meta.get("optional-dependencies", {}).values():
        requirements += extra
    assert "verl" not in _requirement_names(requirements)
    if not project.startswith("apps/"):
        importers = [f for f in (directory / "src").rglob("*.py") if "verl" in _imported_roots(f)]
        assert not importers
