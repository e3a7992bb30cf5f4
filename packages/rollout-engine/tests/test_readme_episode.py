"""The README's multi-turn example (a ten-line custom environment) runs as written."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_custom_environment_runs() -> None:
    text = README.read_text()
    section = text[text.index("### Multi-turn episodes and tools") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    stats, mask = out.getvalue().splitlines()
    assert "delivered=8" in stats and "failed=0" in stats
    assert "0" in mask and mask.startswith("[1")
