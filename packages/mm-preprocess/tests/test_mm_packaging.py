"""`import mm_preprocess` stays light, and a lone install declares what qwen-vl-utils imports."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import mm_preprocess

HEAVY = ("torch", "torchvision", "vllm", "qwen_vl_utils", "transformers")


def test_import_is_light() -> None:
    code = f"import sys, mm_preprocess\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_public_api_is_explicit() -> None:
    assert sorted(mm_preprocess.__all__) == sorted(set(mm_preprocess.__all__))
    for name in mm_preprocess.__all__:
        assert hasattr(mm_preprocess, name), name
    package_dir = Path(mm_preprocess.__file__).parent
    assert (package_dir / "py.typed").exists()


def _requirement_names(dist: str, extra: str | None = None) -> set[str]:
    """Names of `dist`'s requirements: the core ones, or those of one extra."""
    names = set()
    for requirement in importlib.metadata.requires(dist) or []:
        spec, _, marker = requirement.partition(";")
        in_extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", marker)
        if (in_extra.group(1) if in_extra else None) != extra:
            continue
        name = re.split(r"[\s<>=!~\[(]", spec.strip(), maxsplit=1)[0]
        names.add(name.lower().replace("_", "-"))
    return names


def _top_level_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules


def test_every_module_qwen_vl_utils_imports_is_declared() -> None:
    """qwen-vl-utils imports torch, torchvision and numpy without declaring them; this package
    must declare them (itself or through qwen-vl-utils) so a lone install works."""
    spec = importlib.util.find_spec("qwen_vl_utils")
    assert spec is not None
    assert spec.origin is not None
    source = Path(spec.origin).parent / "vision_process.py"
    declared = _requirement_names("mm-preprocess") | _requirement_names("qwen-vl-utils")
    providers = importlib.metadata.packages_distributions()
    optional = {"decord", "torchcodec"}  # imported inside functions, only when installed
    for module in sorted(_top_level_imports(source) - optional):
        if module in sys.stdlib_module_names:
            continue
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        assert dists & declared, f"qwen_vl_utils imports {module} ({dists}); not declared"


def test_processor_extra_declares_transformers() -> None:
    assert "transformers" in _requirement_names("mm-preprocess", extra="processor")
