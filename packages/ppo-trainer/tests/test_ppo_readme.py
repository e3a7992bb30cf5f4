"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    code = code.replace("/tmp/ppo-trainer-example", str(tmp_path / "ckpt"))
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "version 1: " in out
    assert "version 2: " in out
    assert "end_of_stream 4 steps, version 2" in out
    assert (tmp_path / "ckpt" / "model.pt").exists()
