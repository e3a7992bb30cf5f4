"""Presets (TOML round trip, overrides, refusals), the CLI's last JSON line, and a check that
the invariants the property test relies on are really checked (sabotaged admission is caught).
Each test takes well under a second."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import rollout_engine.admission as admission
from sim_app.cli import main
from sim_app.pipeline import simulate
from sim_app.presets import apply_overrides, config_to_toml, list_presets, load_preset
from sim_app.testing import random_config
from sim_app.trainer import StalenessError


def test_built_in_presets_load() -> None:
    presets = list_presets()
    assert {"this-machine", "gpu-7b-64x64"} <= set(presets)
    for name in presets:
        config = load_preset(name).config
        assert config.steps > 0 and config.source


def test_round_trip_and_overrides(tmp_path: Path) -> None:
    preset = load_preset("gpu-7b-64x64", ["max_staleness=4", "lengths.max_tokens=28672"])
    assert preset.config.max_staleness == 4 and preset.config.lengths.max_tokens == 28672
    path = tmp_path / "mine.toml"
    path.write_text(config_to_toml(preset.config, "mine", {"steps": 3}))
    again = load_preset(path)
    assert again.config == preset.config
    assert again.measured == {"steps": 3}
    assert apply_overrides(again.config, ["pacing=eager"]).pacing == "eager"


@pytest.mark.parametrize(
    "bad", [["nonsense=1"], ["decode.nonsense=1"], ["wrong.iteration_s=1"], ["no_equals"]]
)
def test_bad_overrides_are_refused(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        load_preset("this-machine", bad)


def test_unknown_preset_names_the_built_in_ones() -> None:
    with pytest.raises(FileNotFoundError, match="this-machine"):
        load_preset("no-such-preset")


def test_cli_prints_one_json_object_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "this-machine", "--steps", "5", "--variant", "sync"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    assert figures["sim"] == "run" and figures["variants"]["sync (k=0)"]["steps"] == 5


def test_a_broken_admission_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the staleness budget and the delivery-time drop disabled, eager runs put groups
    staler than k in the queue; the queue drops them at get_batch... so disable that too and
    the trainer's own check at consumption must raise."""
    from async_queue import MessageQueue

    monkeypatch.setattr(admission.AdmissionPolicy, "too_stale", lambda self, s: False)
    monkeypatch.setattr(
        admission.AdmissionPolicy,
        "budget",
        lambda self, version, delivered, in_flight, lookahead=None: 10**6 - delivered - in_flight,
    )
    original = MessageQueue.get_batch

    async def unchecked(self, n, timeout=None, *, min_items=1, **_):  # type: ignore[no-untyped-def]
        return await original(self, n, timeout, min_items=min_items)

    monkeypatch.setattr(MessageQueue, "get_batch", unchecked)
    caught = 0
    for seed in random.Random(0).sample(range(100), 12):
        config = random_config(seed).with_(mode="async", max_staleness=1)
        try:
            simulate(config)
        except StalenessError:
            caught += 1
    assert caught >= 6
