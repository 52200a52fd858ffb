"""Driving an engine in tests: submit prompts (all at once or one every few steps), collect outputs.

On ``sys.path`` for every test directory (pytest puts the root conftest's folder there). Imports
no rlt package, so any package's tests may use it.
"""

from __future__ import annotations


def run_arrivals(engine, prompts, params, arrive_every: int = 0, abort: tuple[str, int] | None = None) -> list:
    """Submit ``prompts`` (all at once, or one every ``arrive_every`` steps), step until idle, and
    return the finished outputs in prompt order. ``params``: one SamplingParams or one per prompt.
    ``abort=(request_id, step)`` aborts that request before that step; its output is None."""
    outs, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and (arrive_every == 0 or step % arrive_every == 0):
            take = pending if arrive_every == 0 else pending[:1]
            for i, p in take:
                engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
            pending = pending[len(take):]
        if abort is not None and step == abort[1]:
            engine.abort_request(abort[0])
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    if abort is not None:
        outs.pop(abort[0], None)
        return [outs.get(f"r{i}") for i in range(len(prompts))]
    return [outs[f"r{i}"] for i in range(len(prompts))]
