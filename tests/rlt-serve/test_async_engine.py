"""The engine thread and its asyncio front end, on a real tiny engine (no HTTP).

Covers: outputs equal offline generation, abort frees KV, the bounded admission (Overloaded),
all-or-nothing admission of invalid requests, engine faults inside and outside the engine's own
guard (only the touched requests fail, the loop goes on, faults are counted), the thread dying
(every request fails, the front end reports itself dead), and stop() aborting what is left.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from rlt.platform import EngineConfig, LLMEngine, SamplingParams
from rlt.platform.engine.assembly import EngineAssembly
from rlt.platform.engine.interfaces import Wrapped
from rlt.platform.engine.llm import LLM
from rlt.platform.platforms import detect_platform
from rlt.platform.errors import InvalidRequestError
from rlt.serve.async_engine import AsyncEngine
from rlt.serve.errors import EngineDead, Overloaded
from rlt.serve.metrics import ServerMetrics

from serve_helpers import POISON_TOP_K, PoisonedExecutor


def _engine(path, **kw):
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("max_num_seqs", 8)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", **kw))


def _front(engine, capacity=16):
    metrics = ServerMetrics("tiny", engine.num_loops)
    front = AsyncEngine(engine, capacity=capacity, retry_after=2, metrics=metrics)
    metrics.bind_in_flight(lambda: front.in_flight)
    return front, metrics


async def _finals(gen):
    finals = {}
    async for item in gen:
        if item.finished:
            finals[item.index] = item
    return finals


async def _until(pred, steps=400):
    for _ in range(steps):
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


class _FailingSchedule(Wrapped):
    """A scheduler policy whose second ``schedule()`` raises: a defect outside the step guard."""

    calls = 0

    def schedule(self):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("scheduler bug")
        return self.inner.schedule()


def _engine_wrapping(path, component, wrapper, **kw):
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("max_num_seqs", 8)
    assembly = EngineAssembly(detect_platform("cpu"))
    assembly.wrap(component, lambda ctx, inner: wrapper(inner), by="test")
    return assembly.build_engine(EngineConfig(model=str(path), dtype="float32", **kw))


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(seed=7)


def test_outputs_equal_offline_generation(ckpt):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
    params = [SamplingParams(max_tokens=6, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(3)]
    want = LLM.from_config(EngineConfig(model=str(ckpt), dtype="float32", num_kv_blocks=256)).generate(prompts, params)

    async def main():
        front, metrics = _front(_engine(ckpt))
        await front.start()
        gen = await front.generate([(i, f"r{i}", p, params[i]) for i, p in enumerate(prompts)])
        finals = await _finals(gen)
        await front.stop()
        return finals, front, metrics

    finals, front, metrics = asyncio.run(main())
    for i, w in enumerate(want):
        out = finals[i].output
        assert out.token_ids == w.token_ids and out.text == w.text and out.exit_depths == w.exit_depths
        assert out.finish_reason == "length"
    assert front.in_flight == 0
    text = metrics.render().decode()
    assert 'rlt:requests_total{model_name="tiny",outcome="length"} 3.0' in text
    assert 'rlt:generation_tokens_total{model_name="tiny"} 18.0' in text
    assert 'rlt:prompt_tokens_total{model_name="tiny"} 10.0' in text
    assert 'rlt:token_exit_depth_count{model_name="tiny"} 18.0' in text
    assert 'rlt:mean_exit_depth{model_name="tiny"} 4.0' in text


def test_abort_frees_kv_and_slot(ckpt):
    async def main():
        front, _ = _front(_engine(ckpt))
        await front.start()
        gen = await front.generate([(0, "long", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))])
        seen = []
        async for item in gen:
            seen.append(item)
            if len(seen) == 1:
                assert front.stats().kv_usage > 0
                gen.abort()
        assert await _until(lambda: front.stats().kv_usage == 0.0 and front.stats().num_running == 0)
        in_flight = front.in_flight
        await front.stop()
        return seen, in_flight

    seen, in_flight = asyncio.run(main())
    last = seen[-1].output
    assert last.finished and last.finish_reason == "abort" and len(last.token_ids) < 200
    assert in_flight == 0


def test_admission_is_bounded(ckpt):
    async def main():
        front, _ = _front(_engine(ckpt), capacity=2)
        await front.start()
        sp = SamplingParams(max_tokens=2)
        with pytest.raises(Overloaded) as info:
            await front.generate([(i, f"x{i}", [5, 6], sp) for i in range(3)])
        assert front.in_flight == 0  # nothing was queued
        gen = await front.generate([(i, f"y{i}", [5, 6], sp) for i in range(2)])
        with pytest.raises(Overloaded):
            await front.generate([(0, "z", [5, 6], sp)])
        finals = await _finals(gen)
        gen2 = await front.generate([(0, "z", [5, 6], sp)])  # capacity is back once they finished
        await _finals(gen2)
        await front.stop()
        return info.value, finals

    err, finals = asyncio.run(main())
    assert err.status == 503 and err.headers == {"Retry-After": "2"}
    assert len(finals) == 2


def test_invalid_request_admits_nothing(ckpt):
    """A refused prompt refuses its whole HTTP request before any of it runs: the valid prompts ahead of it
    are withdrawn in the same pass (no step, no prompt tokens counted, no aborted requests), and the
    engine goes on serving."""
    async def main():
        front, metrics = _front(_engine(ckpt, max_model_len=32))
        await front.start()
        good = [(i, f"good{i}", [5, 6, 7, 8][: i + 2], SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(3)]
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            await front.generate([*good, (3, "bad", list(range(3, 40)), SamplingParams(max_tokens=2))])
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await front.generate([(0, "oov", [5, 10**6], SamplingParams())])
        settled = await _until(lambda: front.in_flight == 0 and front.stats().num_running == 0)
        refused = (front.stats().num_steps, metrics.prompt_tokens._value.get(),
                   metrics.registry.get_sample_value("rlt:requests_total", {"model_name": "tiny", "outcome": "abort"}))
        finals = await _finals(await front.generate(good[:1]))  # the same ids again: nothing of them was left
        await front.stop()
        return settled, refused, finals

    settled, refused, finals = asyncio.run(main())
    assert settled and refused == (0, 0, 0)
    assert finals[0].output.finish_reason == "length" and len(finals[0].output.token_ids) == 20


def test_fault_inside_a_step_fails_only_the_requests_of_that_step(ckpt):
    async def main():
        engine = _engine_wrapping(ckpt, "executor", PoisonedExecutor, max_num_seqs=1)
        front, metrics = _front(engine)
        await front.start()
        bad = await front.generate([(0, "bad", [5, 6], SamplingParams(max_tokens=4, top_k=POISON_TOP_K))])
        good = await front.generate([(0, "good", [5, 6], SamplingParams(max_tokens=4))])  # waits: one slot
        bad_final, good_final = (await _finals(bad))[0], (await _finals(good))[0]
        await front.stop()
        return bad_final, good_final, metrics, front

    bad, good, metrics, front = asyncio.run(main())
    assert bad.output.finish_reason == "abort" and "injected fault" in bad.output.error
    assert good.output.error is None and good.output.finish_reason == "length"
    assert 'rlt:engine_faults_total{model_name="tiny"} 1.0' in metrics.render().decode()
    assert 'outcome="error"} 1.0' in metrics.render().decode()


def test_fault_outside_the_engine_guard_is_contained(ckpt):
    async def main():
        engine = _engine_wrapping(ckpt, "scheduler", _FailingSchedule)
        front, metrics = _front(engine)
        await front.start()
        gen = await front.generate([(0, "a", [5, 6], SamplingParams(max_tokens=8, ignore_eos=True))])
        first = (await _finals(gen))[0]
        after = await front.generate([(0, "b", [5, 6], SamplingParams(max_tokens=3))])
        second = (await _finals(after))[0]
        faults = front.thread_faults
        await front.stop()
        return first, second, faults, metrics, front

    first, second, faults, metrics, front = asyncio.run(main())
    assert first.output.finish_reason == "abort" and "scheduler bug" in first.output.error
    assert second.output.finish_reason == "length" and second.output.error is None
    assert faults == 1 and front.in_flight == 0
    assert 'rlt:engine_faults_total{model_name="tiny"} 1.0' in metrics.render().decode()


def test_thread_death_fails_everything_and_reports_dead(ckpt, caplog):
    async def main():
        engine = _engine(ckpt)
        real_stats = engine.stats
        state = {"armed": False}

        def stats():
            if state["armed"]:
                raise SystemError("corrupted")
            return real_stats()

        engine.stats = stats
        front, _ = _front(engine)
        await front.start()
        gen = await front.generate([(0, "a", [5, 6], SamplingParams(max_tokens=100, ignore_eos=True))])
        state["armed"] = True
        final = (await _finals(gen))[0]
        assert await _until(lambda: not front.alive)
        with pytest.raises(EngineDead):
            await front.generate([(0, "b", [5, 6], SamplingParams())])
        return final, front

    final, front = asyncio.run(main())
    assert final.output is None and "engine thread died" in final.error
    # the reason (served by /health) names an error id, not the exception; the log has the traceback
    assert "SystemError" not in front.dead_reason and front.in_flight == 0
    error_id = re.search(r"error id (err-[0-9a-f]+)", front.dead_reason).group(1)
    record = next(r for r in caplog.records if error_id in r.getMessage())
    assert record.exc_info[0] is SystemError


def test_stop_aborts_what_is_left(ckpt):
    async def main():
        front, _ = _front(_engine(ckpt))
        await front.start()
        gen = await front.generate([(0, "a", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True))])
        it = gen.__aiter__()
        await it.__anext__()
        await front.stop()
        rest = [item async for item in it]
        return rest, front

    rest, front = asyncio.run(main())
    assert rest[-1].output.finish_reason == "abort"
    assert not front.alive and front.in_flight == 0


def test_a_generation_wakes_once_for_everything_delivered_meanwhile():
    from rlt.serve.async_engine import Generation, Item

    class _Front:
        aborted: list = []

        def abort(self, rid):
            self.aborted.append(rid)

    async def main():
        gen = Generation(_Front(), ["a", "b"])
        got = []

        async def consume():
            async for batch in gen.batches():
                got.append([i.request_id for i in batch])

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # the consumer now waits
        for rid in ("a", "b", "a"):
            gen.put(Item(0, rid, None, 0.0, None if rid != "b" else "failed"))
        gen.put(Item(0, "a", None, 0.0, "failed"))
        await task
        return got, gen

    got, gen = asyncio.run(main())
    assert got == [["a", "b", "a", "a"]] and gen.done
