"""SimEngine on its own, on a looptime loop: timings against the decode model's arithmetic,
pause modes, versions per token, continuations, failures and cancellation. Each test takes
milliseconds of CPU."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from typing import Any

import pytest
from rollout_engine import GenerationEngine, SamplingConfig
from sim_app.engine import SimEngine
from sim_app.models import DecodeModel, LengthModel
from sim_app.pipeline import new_loop


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = new_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _fixed(length: int, max_tokens: int = 64) -> LengthModel:
    return LengthModel(kind="histogram", histogram=((length, 1.0),), max_tokens=max_tokens)


SAMPLING = SamplingConfig(max_tokens=64)


def test_is_a_generation_engine() -> None:
    assert isinstance(SimEngine(DecodeModel(), _fixed(4)), GenerationEngine)


def test_one_request_takes_prefill_plus_its_decode_iterations() -> None:
    decode = DecodeModel(iteration_s=0.01, per_seq_s=0.001, prefill_s=0.05)
    engine = SimEngine(decode, _fixed(10))

    async def main() -> tuple[float, list[Any]]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        out = await engine.generate("p0:0", [1, 2, 3], SAMPLING, n=4)
        return loop.time() - start, out

    elapsed, completions = _run(main())
    assert elapsed == pytest.approx(0.05 + 10 * (0.01 + 4 * 0.001), abs=1e-5)
    assert [len(c.token_ids) for c in completions] == [10] * 4
    assert all(c.finish_reason == "stop" and c.token_ids[-1] == 0 for c in completions)
    assert all(c.versions == [0] * 10 for c in completions)


def test_context_cost_is_integrated_exactly() -> None:
    """per_ctx_token_s: an iteration's cost grows with the context; the fluid model solves the
    quadratic instead of stepping."""
    decode = DecodeModel(iteration_s=0.002, per_ctx_token_s=1e-5)
    engine = SimEngine(decode, _fixed(50, max_tokens=100), token_unit=5)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await engine.generate("p0:0", [1] * 4, SamplingConfig(max_tokens=20), n=2)
        return loop.time() - start

    # 10 units of 5 tokens, 2 sequences, prompt 4 units = 20 tokens each.
    expected = sum(5 * (0.002 + 1e-5 * 2 * (20 + 5 * j)) for j in range(10))
    expected += 5 * 5 * 1e-5 * 2 * 10 / 2  # the growth within each unit
    assert _run(main()) == pytest.approx(expected, rel=1e-3)


def test_lengths_are_seeded_by_prompt_and_capped_at_max_tokens() -> None:
    lengths = LengthModel(median=20, sigma=1.5, max_tokens=40, cap_fraction=0.2)
    sampling = SamplingConfig(max_tokens=40)

    async def draw(seed: int, request: str) -> list[int]:
        engine = SimEngine(DecodeModel(iteration_s=1e-3), lengths, seed=seed)
        return [len(c.token_ids) for c in await engine.generate(request, [1], sampling, n=16)]

    a = _run(draw(1, "p7:0"))
    assert a == _run(draw(1, "p7:3"))  # the same prompt, admitted later: same lengths
    assert a != _run(draw(2, "p7:0"))
    assert max(a) <= 40 and min(a) >= 1


def test_keep_pause_freezes_and_new_tokens_carry_the_new_version() -> None:
    decode = DecodeModel(iteration_s=0.01, pause_s=0.002, load_s=0.1, resume_s=0.003)
    engine = SimEngine(decode, _fixed(10))

    async def main() -> tuple[float, list[Any]]:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(engine.generate("p0:0", [1], SAMPLING, n=2))
        await asyncio.sleep(0.0405)  # 4 tokens done
        await engine.pause("keep")
        assert not engine.busy
        await engine.load_weights(None, 1)
        await engine.resume()
        out = await task
        return loop.time(), out

    end, completions = _run(main())
    assert end == pytest.approx(0.1 + 0.002 + 0.1 + 0.003, abs=1e-5)  # 10 tokens + the push
    assert completions[0].versions == [0] * 4 + [1] * 6
    assert completions[0].finish_reason == "stop"


def test_abort_returns_tokens_so_far_and_the_continuation_finishes_the_same_response() -> None:
    engine = SimEngine(DecodeModel(iteration_s=0.01), _fixed(10))

    async def main() -> tuple[Any, Any]:
        task = asyncio.ensure_future(engine.generate("g1", [1, 2], SAMPLING, n=1))
        await asyncio.sleep(0.0305)
        await engine.pause("abort")
        [partial] = await task
        await engine.load_weights(None, 1)
        await engine.resume()
        [rest] = await engine.generate(
            "g1:0:r1",
            [1, 2, *partial.token_ids],
            SamplingConfig(max_tokens=64 - len(partial.token_ids)),
        )
        return partial, rest

    partial, rest = _run(main())
    assert partial.finish_reason == "abort" and len(partial.token_ids) == 3
    assert partial.versions == [0, 0, 0]
    assert rest.finish_reason == "stop" and len(rest.token_ids) == 7
    assert rest.versions == [1] * 7
    assert rest.token_ids[-1] == 0


def test_wait_pause_returns_when_everything_finished() -> None:
    engine = SimEngine(DecodeModel(iteration_s=0.01, pause_s=5.0), _fixed(10))

    async def main() -> float:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(engine.generate("p0:0", [1], SAMPLING, n=3))
        await asyncio.sleep(0.02)
        await engine.pause("wait")  # pause_s is the cost of keep/abort, not of a drain
        assert task.done()
        return loop.time()

    assert _run(main()) == pytest.approx(0.1, abs=1e-5)


def test_requests_beyond_max_num_seqs_wait_for_room() -> None:
    engine = SimEngine(DecodeModel(iteration_s=0.01, max_num_seqs=4), _fixed(10))

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        done: list[float] = []

        async def one(i: int) -> None:
            await engine.generate(f"p{i}:{i}", [1], SAMPLING, n=4)
            done.append(loop.time())

        await asyncio.gather(*(one(i) for i in range(3)))
        return done

    assert _run(main()) == pytest.approx([0.1, 0.2, 0.3], abs=1e-5)


def test_injected_failures_raise_and_free_the_batch() -> None:
    engine = SimEngine(DecodeModel(iteration_s=0.01), _fixed(10), failure_rate=0.5, seed=3)

    async def main() -> tuple[int, int]:
        results = await asyncio.gather(
            *(engine.generate(f"p{i}:{i}", [1], SAMPLING, n=2) for i in range(40)),
            return_exceptions=True,
        )
        failed = sum(isinstance(r, RuntimeError) for r in results)
        return failed, engine.running_sequences

    failed, running = _run(main())
    assert 10 < failed < 30
    assert running == 0
    assert engine.stats.failures == failed


def test_a_cancelled_request_leaves_the_batch() -> None:
    engine = SimEngine(DecodeModel(iteration_s=0.01, per_seq_s=0.01), _fixed(10))

    async def main() -> float:
        loop = asyncio.get_running_loop()
        slow = asyncio.ensure_future(engine.generate("p0:0", [1], SAMPLING, n=8))
        fast = asyncio.ensure_future(engine.generate("p1:1", [1], SAMPLING, n=1))
        await asyncio.sleep(0.05)
        slow.cancel()
        await fast
        assert engine.running_sequences == 0
        return loop.time()

    # 0.05 s at 9 sequences (0.1 s a token: 0.5 token), then 1 sequence at 0.02 s a token.
    assert _run(main()) == pytest.approx(0.05 + 9.5 * 0.02, abs=1e-5)


def test_speed_factor_slows_decoding_from_now_on() -> None:
    engine = SimEngine(DecodeModel(iteration_s=0.01), _fixed(10))

    async def main() -> float:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(engine.generate("p0:0", [1], SAMPLING, n=1))
        await asyncio.sleep(0.05)
        engine.set_speed(0.5)
        await task
        return loop.time()

    assert _run(main()) == pytest.approx(0.05 + 0.1, abs=1e-5)
    assert math.isclose(engine.stats.busy_s, 0.15, abs_tol=1e-5)
