"""Helpers shared by the composition tests (plain functions, not fixtures)."""


def run_with_arrivals(engine, items, every: int) -> list:
    """Submit ``items`` ((prompt, params) pairs) one every ``every`` steps while earlier ones decode,
    step until idle; the finished outputs in submission order (request ids ``r0``, ``r1``, ...)."""
    done, pending, step = {}, list(enumerate(items)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, (p, sp) = pending.pop(0)
            engine.add_request(f"r{i}", p, sp)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        step += 1
    return [done[f"r{i}"] for i in range(len(items))]
