"""Does splitting a decode step's rows into groups on parallel streams pay? A probe (issue 10, C=64).

At C=64 with 1K-token contexts a loop step is ~3.3 ms of decode attention (KV bytes, ~92 % of their
floor) and ~1 ms of projections that stream 0.57 ms worth of weight bytes: the projections' fixed
cost per kernel (launch, ramp-up, tail) is where the 3,800 tok/s target's 8 % is. Rows are
independent within a loop step, so the rows can be cut into G groups whose layer sequences run on G
streams: one group's projections then run while another's attention streams KV, hiding their fixed
cost, at the price of reading each projection's weights G times (twice at G = 2: +0.57 ms of bytes
at worst, less where the groups read the same weights at about the same time and L2 serves the
second read).

This brings an engine (rlt-decode composed) to steady decode at C rows and ``--prompt-len`` tokens,
then times, as CUDA graphs of the engine's own loop step (``model.recurrent`` over the rows' static
fields, as :meth:`rlt.decode.executor.StaticDecodeExecutor._loop_step` runs it; the rows' inputs
are fixed copies of their states, so replays repeat the same work):

* ``one``: every row in one call (what the engine does);
* ``seq-G``: G groups one after another on one stream (the cost of the split alone);
* ``par-G``: G groups forked onto G streams inside one graph, joined at the end.

Median of ``--reps`` means of ``--iters`` replays after a warm-up, per G in ``--groups``. Each
variant's outputs are checked against ``one`` (rows are independent: the same values up to kernel
shape rounding) — which matters for ``par-G``: groups of one row count share the Triton decode
attention's split scratch (one buffer per shape, safe on the engine's one stream), so parallel groups
whose attention splits overwrite each other's partial sums and report a large error (lease 16: four
groups of 16 rows). It measures and changes nothing; on CPU it runs the same calls eagerly (no
streams) so its logic is tested. ::

    python -m benchmarks.row_split_overlap --rows 64 --prompt-len 1024 --out split.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.bench_model import NAMED_CONFIGS, write_random_checkpoint
from benchmarks.roofline import timed
from benchmarks.workload import EngineOptions, Workload, prompts_for
from rlt.attention import AttentionMetadata, KVLayout
from rlt.decode.batch import context_bucket
from rlt.platform.sampling_params import SamplingParams


def find_static(engine):
    """rlt-decode's static decode executor inside ``engine`` (walking the wrappers), or raise."""
    ex = engine.core.executor
    while ex is not None:
        if type(ex).__name__ == "StaticDecodeExecutor":
            return ex
        ex = ex.__dict__.get("inner")
    raise RuntimeError("no StaticDecodeExecutor in this engine: compose rlt.decode.feature")


def steady_engine(model_dir: str, *, rows: int, prompt_len: int, backend: str, device: str, loops: int):
    """An engine with rlt-decode, ``rows`` requests past their prompts, and its static executor at its
    last decode step's bucket (the buffers then hold ``rows`` real rows)."""
    wl = Workload(name="split", concurrency=rows, prompt_len=prompt_len, output_len=16 * loops, num_requests=rows)
    opts = EngineOptions(device=device, feature_modules=("rlt.decode.feature",))
    engine = opts.build_engine(opts.engine_config(model_dir, wl, backend=backend, num_loops=loops))
    params = SamplingParams(max_tokens=wl.output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts_for(wl, engine.ctx.model.shape.vocab_size, 0, rows)):
        engine.add_request(f"split-{i}", p, params)
    ex = find_static(engine)
    for _ in range(16 * loops):
        engine.step()
        if ex.stats.get("graph_replays", 0) + ex.stats.get("eager_decode_steps", 0) >= 2 * loops:
            break
    else:
        raise RuntimeError("the engine did not reach static decode steps")
    return engine, ex


def group_step(ex, bucket: int, context: int, lo: int, hi: int, x: torch.Tensor) -> torch.Tensor:
    """One loop of rows ``lo:hi`` of the static fields from the fixed inputs ``x[lo:hi]`` (the engine's
    loop step without its input gather, state write and gate)."""
    f = ex.buffers.fields(bucket)
    r = slice(lo, hi)
    pages = -(-context // ex.kv.block_size)
    meta = AttentionMetadata(
        query_start_loc=ex.buffers.qsl[: hi - lo + 1], seq_lens=f.seq_len[r], query_depth=f.depth[r],
        block_tables=ex.buffers.tables.index_select(0, f.slot[r])[:, :, :pages], slot_mapping=f.slot_mapping[r],
        plane0_slot_mapping=f.plane0[r], token_query_depth=f.depth[r], positions=f.position[r], max_query_len=1,
        max_seq_len=context, layout=ex.kv.layout)
    if ex.kv.layout is KVLayout.LAST_EXITED:
        ex.kv.stamp_depth(f.plane0[r], f.depth[r])
    meta = ex.attention.prepare(ex.kv, meta)
    return ex.model.recurrent(x[r], ex.model.rotary(f.position[r]), ex.kv, ex.attention, meta)


def bounds(rows: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous row ranges covering ``rows``, sizes differing by at most one."""
    if not 1 <= groups <= rows:
        raise ValueError(f"groups must be in 1..{rows}, got {groups}")
    cuts = [rows * g // groups for g in range(groups + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def variant(ex, bucket: int, context: int, x: torch.Tensor, rows: int, groups: int, parallel: bool, out: torch.Tensor):
    """The function a variant captures: every group's loop, writing its rows of ``out``; with
    ``parallel`` (CUDA) group g > 0 runs on its own stream forked from and joined to the current one."""
    streams = [torch.cuda.Stream() for _ in range(groups - 1)] if parallel and x.is_cuda else []

    def run():
        main = torch.cuda.current_stream() if x.is_cuda else None
        for g, (lo, hi) in enumerate(bounds(rows, groups)):
            if g and streams:
                s = streams[g - 1]
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    out[lo:hi] = group_step(ex, bucket, context, lo, hi, x)
            else:
                out[lo:hi] = group_step(ex, bucket, context, lo, hi, x)
        for s in streams:
            main.wait_stream(s)

    return run


def ms_per_call(fn, cuda: bool, iters: int, reps: int) -> float:
    """Median over ``reps`` of the mean ms of ``iters`` calls (graph replays on CUDA), after a warm-up."""
    if cuda:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    fn()

    def batch():
        for _ in range(iters):
            fn()

    return statistics.median(timed(batch, torch.device("cuda" if cuda else "cpu"), reps)) * 1e3 / iters


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="ouro-1.4b",
                    help=f"a checkpoint directory or one of {', '.join(NAMED_CONFIGS)} (random weights)")
    ap.add_argument("--work-dir", default="/tmp/rlt-split")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--groups", default="2,4")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    path = Path(args.model)
    if not path.is_dir():
        path = Path(args.work_dir) / f"{args.model}-random-seed0"
        if not (path / "config.json").is_file():
            dev = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
            write_random_checkpoint(path, args.model, seed=0, device=torch.device(dev))
    cfg = json.loads((path / "config.json").read_text())
    loops = cfg.get("total_ut_steps") or cfg.get("num_loops") or cfg.get("mean_recurrence")
    engine, ex = steady_engine(str(path), rows=args.rows, prompt_len=args.prompt_len, backend=args.backend,
                               device=args.device, loops=loops)
    cuda = engine.device.type == "cuda"
    # the first ``rows`` entries of every static field are the step's rows (any larger bucket pads after them)
    bucket = args.rows
    f = ex.buffers.fields(bucket)
    # the context bucket the engine's own graph of this step uses
    context = context_bucket(int(f.seq_len[: args.rows].max().item()), engine.ctx.max_model_len)
    x = ex.states.index_select(0, f.state[: args.rows]).clone()
    report = {"rows": args.rows, "prompt_len": args.prompt_len, "context_bucket": context, "device":
              torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__, "variants": {}}
    ref = torch.empty_like(x)
    with torch.inference_mode():
        ms = ms_per_call(variant(ex, bucket, context, x, args.rows, 1, False, ref), cuda, args.iters, args.reps)
        report["variants"]["one"] = {"ms": ms}
        print(f"one      {ms:8.3f} ms per loop step", flush=True)
        for groups in (int(g) for g in args.groups.split(",")):
            for parallel in (False, True):
                out = torch.empty_like(x)
                name = f"{'par' if parallel else 'seq'}-{groups}"
                ms = ms_per_call(variant(ex, bucket, context, x, args.rows, groups, parallel, out), cuda, args.iters, args.reps)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
                report["variants"][name] = {"ms": ms, "rel_err": err}
                print(f"{name:8s} {ms:8.3f} ms per loop step  ({ms / report['variants']['one']['ms']:.3f}x one, "
                      f"rel err {err:.1e})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    del engine
    gc.collect()
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
