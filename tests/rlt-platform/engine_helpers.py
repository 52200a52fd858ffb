"""Helpers shared by the rlt-platform engine tests (not fixtures: plain functions)."""


def drain(engine) -> dict:
    """Step ``engine`` until idle; the finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done
