"""The persistent loop kernel's plan (rlt.decode.persistent.plan), emulated in torch on CPU, is
``OuroModel.recurrent`` at one decode row: the packed stages dealt tile by tile over the CTAs, the
attention items' context splits (empty ones included) and their merge, the two residual buffers, the
K/V rows stored at the token's slot — in fp32 to rounding, and in bf16 with the kernel-per-op path's
rounding points. A device call of the probe then has only the CUDA side left to get right."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.bench_model import random_weights
from rlt.decode.persistent import plan as loop
from rlt.attention.synthetic import random_problem
from rlt.attention.backends.torch_ref import TorchReferenceBackend
from rlt.attention.gather import key_slots
from rlt.platform.checkpoint.tiny import tiny_config
from rlt.platform.models import MODEL_FAMILIES

OURO = MODEL_FAMILIES["ouro"]


def _weights(cfg, dtype, seed: int) -> dict[str, torch.Tensor]:
    return random_weights("ouro", cfg, seed=seed, gate_bias=0.0, dtype=dtype, device="cpu")


def _setup(dtype, kv_heads: int, context: int, depth: int = 1, planes: int = 3, bs: int = 8, seed: int = 0):
    """A 2-layer Ouro model of the kernel's shapes and one decode row at ``context`` (random_problem: random
    pages per plane, random exit depths in the history, the running token stamped at ``depth``)."""
    cfg = OURO.parse_config(tiny_config("ouro", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=128))
    model = OURO.build_runtime(cfg, _weights(cfg, dtype, seed))
    prob = random_problem([(context, 1, depth)], num_heads=4, num_kv_heads=kv_heads, head_dim=128, block_size=bs,
                          num_planes=planes, dtype=dtype, num_layers=2, seed=seed + 1)
    hidden = torch.randn(512, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    return model, prob.kv, prob.meta, hidden, int(prob.meta.slot_mapping[0])


def _fp32(model, seed: int, hidden, kv, meta) -> torch.Tensor:
    """The loop step in fp32 on the same bf16 weights (``_weights(..., seed)``) and cache."""
    return loop.fp32_loop_step(OURO, model.cfg, _weights(model.cfg, torch.bfloat16, seed), hidden[None], kv,
                               TorchReferenceBackend(), meta)[0]


def _run_both(dtype, kv_heads, context, ctas):
    model, kv, meta, hidden, slot = _setup(dtype, kv_heads, context)
    cos, sin = model.rotary(meta.positions)
    slots = key_slots(kv, meta, context)[0]
    k_em, v_em = kv.k.clone(), kv.v.clone()
    nkv = kv_heads
    out = loop.emulate(model, loop.pack(model), hidden, cos, sin, k_em.view(2, -1, nkv, 128),
                       v_em.view(2, -1, nkv, 128), slots, slot, context, ctas, rounding=dtype != torch.float32)
    ref = model.recurrent(hidden[None], (cos, sin), kv, TorchReferenceBackend(), meta)[0]
    return out, ref.float(), (k_em, v_em), (kv.k, kv.v)


@pytest.mark.parametrize("ctas,kv_heads,context", [(1, 4, 37), (5, 2, 37), (7, 4, 200), (64, 2, 21)])
def test_emulated_loop_is_the_recurrent_step_fp32(ctas, kv_heads, context):
    """One CTA (one split a head), uneven dealing, many splits, and (64 CTAs, 21 positions) splits with no
    cached keys, the last holding only the new token."""
    out, ref, kv_em, kv_ref = _run_both(torch.float32, kv_heads, context, ctas)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for a, b in zip(kv_em, kv_ref):  # the new K/V rows at the token's slot, and nothing else written
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


@pytest.mark.parametrize("ctas,seed", [(3, 0), (16, 1), (16, 2)])
def test_emulated_loop_in_bf16_is_as_close_to_fp32_as_the_bf16_path(ctas, seed):
    """bf16 (the kernel's rounding points): as close to the fp32 arithmetic of the same weights and cache as
    the kernel-per-op bf16 path is. Not bit-equal to that path in general: the attention's exp2 softmax and
    the sums' order can flip an element of o by an ulp, and a flip moves every output of the next projection a
    little (measured on these three draws: bit-equal to it, 7.2-7.5e-3 from fp32; on an earlier set of draws one
    flip in 512 left 44 % of the output element-equal, 8.5e-3 from fp32 against the bf16 path's 7.1e-3)."""
    model, kv, meta, hidden, slot = _setup(torch.bfloat16, 2, 60, seed=seed)
    cos, sin = model.rotary(meta.positions)
    slots = key_slots(kv, meta, 60)[0]
    k_em, v_em = kv.k.clone(), kv.v.clone()
    out = loop.emulate(model, loop.pack(model), hidden, cos, sin, k_em.view(2, -1, 2, 128), v_em.view(2, -1, 2, 128),
                       slots, slot, 60, ctas)
    oracle = _fp32(model, seed, hidden, kv, meta)
    ref = model.recurrent(hidden[None], (cos, sin), kv, TorchReferenceBackend(), meta)[0].float()
    rel = lambda a: ((a - oracle).abs().max() / oracle.abs().max()).item()
    assert 0 < rel(ref) < 0.05
    assert rel(out) <= 2 * rel(ref)
    assert torch.equal(k_em[0], kv.k[0]) and torch.equal(v_em[0], kv.v[0])  # layer 0's stored K/V rows: bit-equal


# -- the engine path: the static decode executor runs one-row steps through the loop ----------------------
KERNEL_SHAPES = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=128)


class Counting:
    """An :class:`EmulatedLoop` that counts its launches."""

    def __init__(self, impl):
        self.impl, self.calls = impl, 0
        self.kind, self.lw, self.ctas = impl.kind, impl.lw, impl.ctas

    def __call__(self, *args):
        self.calls += 1
        self.impl(*args)


def _with_emulated_loop(engine, ctas: int = 5) -> Counting:
    from rlt.decode.persistent import EmulatedLoop, PersistentLoop

    ex = engine.ctx.parts.executor
    impl = Counting(EmulatedLoop(ex.model, loop.pack(ex.model), ctas=ctas))
    ex.persistent = PersistentLoop(ex.kv, impl)
    return impl


@pytest.mark.parametrize("layout,tau", [("last_exited", 1.0), ("shared", 1.0), ("last_exited", 0.5)])
def test_engine_one_row_steps_through_the_loop_equal_the_oracle(tiny_checkpoint, layout, tau):
    """fp32 greedy, the loop's plan standing in for the kernel: one request alone (every decode step one row),
    then three arriving one by one (one-row steps first, then 2- and 4-row buckets through ``recurrent``):
    token-identical to the oracle and to the base engine, exit depths included — at fixed depth and with
    adaptive exit (tau 0.5: one-row steps at every depth, each reading its own KV plane)."""
    from rlt.platform import EngineConfig, LLMEngine, SamplingParams
    from rlt.platform.checkpoint import load_checkpoint
    from rlt.platform.composition import build_engine
    from rlt.platform.models.ouro_reference import reference_generate

    from engine_driver import run_arrivals as run

    path = tiny_checkpoint(seed=3, gate_bias=0.5, **KERNEL_SHAPES)
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, kv_layout=layout)
    base, static = LLMEngine(config), build_engine(config, enabled={"static_buffers": True})
    impl = _with_emulated_loop(static)
    ck = load_checkpoint(path, dtype=torch.float32)
    ref = ck.family.build_reference(ck.config, ck.weights)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=tau)
    for prompts, every in (([[5, 17, 33, 2, 9]], 0), ([[7, 8, 9], [40, 41, 42, 43, 44, 45], [100, 3]], 4)):
        got = run(static, prompts, sp, arrive_every=every)
        assert [o.token_ids for o in got] == [o.token_ids for o in run(base, prompts, sp, arrive_every=every)]
        for p, o in zip(prompts, got):
            want, depths = reference_generate(ref, p, max_tokens=6, layout=layout, exit_threshold=tau)
            assert list(o.token_ids) == want and list(o.exit_depths) == depths
    assert impl.calls > 0
    if tau < 1:  # rows really exited at different depths
        assert len({d for o in got for d in o.exit_depths}) > 1
    info = static.describe()["executor"]["persistent_loop"]
    assert info["kernel"] == "emulated" and info["rows"] == 1


def test_feature_off_by_default_and_absent_on_cpu(tiny_checkpoint):
    from rlt.platform import EngineConfig
    from rlt.platform.composition import build_engine

    engine = build_engine(EngineConfig(model=str(tiny_checkpoint(seed=1)), dtype="float32"))
    rows = {s.name: s for s in engine.features}
    assert not rows["persistent_loop"].enabled and not rows["persistent_loop"].available
    assert "graph_capture" in rows["persistent_loop"].reason
    assert engine.describe()["executor"]["persistent_loop"] is None


def test_options_parse_from_the_server_flags_and_refuse_out_of_range():
    """``--persistent-loop-stages`` / ``--persistent-loop-l2-ahead`` through the platform's flag machinery (as
    ``rlt-server serve`` parses them); a value out of range is a clear error naming the flag."""
    import argparse

    from rlt.decode.feature import FEATURES
    from rlt.platform.features import add_feature_arguments, options_from_args

    parser = argparse.ArgumentParser(add_help=False)
    add_feature_arguments(parser, FEATURES)
    args = parser.parse_args(["--persistent-loop", "--persistent-loop-stages", "8", "--persistent-loop-l2-ahead", "16"])
    switches, options = options_from_args(FEATURES, args)
    assert switches["persistent_loop"] is True
    assert (options["persistent_loop"].stages, options["persistent_loop"].l2_ahead) == (8, 16)
    for flag, value in (("--persistent-loop-stages", "1"), ("--persistent-loop-l2-ahead", "33")):
        with pytest.raises(ValueError, match=flag):
            options_from_args(FEATURES, parser.parse_args(["--persistent-loop", flag, value]))


def test_build_refuses_what_the_kernel_cannot_run(tiny_checkpoint):
    """Each reason is named: a model of other shapes, fp32 weights, a device that is not an NVIDIA GPU."""
    from rlt.decode.persistent import build_persistent_loop

    model, kv, *_ = _setup(torch.bfloat16, 2, 20)
    with pytest.raises(ValueError, match="NVIDIA GPU"):
        build_persistent_loop(model, kv, torch.device("cpu"))
    model32, kv32, *_ = _setup(torch.float32, 2, 20)
    with pytest.raises(ValueError, match="runs bf16"):
        build_persistent_loop(model32, kv32, torch.device("cpu"))
    cfg = OURO.parse_config(tiny_config("ouro", hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, head_dim=64))
    small = OURO.build_runtime(cfg, _weights(cfg, torch.bfloat16, 0))
    with pytest.raises(ValueError, match="head_dim 64"):
        build_persistent_loop(small, kv, torch.device("cpu"))
    with pytest.raises(ValueError, match="head_dim 64"):
        loop.pack(small)


def test_the_kernel_compiles_for_sm90_without_spills():
    """loop_kernel.cu through NVRTC (rlt-decode's test environment installs nvidia-cuda-nvrtc-cu12; no GPU needed):
    sm_90a machine code with every define at its default, at the ring depths the option allows, both consumer-warp
    counts and with the producer's L2 prefetches and early V loads, no spills, registers
    within what one CTA a SM may use (64K a SM over its 32 + 32 x warps threads), and shared memory at 12 stages
    within the 227 KB a Hopper block may have."""
    from rlt.decode.persistent import cuda

    lib = cuda.find_nvrtc()
    assert lib, "libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12 (rlt-decode's test environment has it)"
    for defines in ({}, dict(NSTAGES=2), dict(CONSUMER_WARPS=4), dict(L2_AHEAD=16, V_EARLY=16)):
        warps = defines.get("CONSUMER_WARPS", 8)  # (what an absent define defaults to: persistent.cuh)
        cubin, log = cuda.nvrtc_compile(lib, defines, cuda.LOOP_SOURCE, verbose=True)
        assert cubin[:4] == b"\x7fELF" and "ouro_loop" in log
        assert "0 bytes spill stores, 0 bytes spill loads" in log, log
        regs = int(re.search(r"Used (\d+) registers", log).group(1))
        assert regs <= 255 and regs * 32 * (1 + warps) <= 65536, (warps, regs)
    assert cuda.loop_shared_bytes(12) <= 227 * 1024


# -- the CUDA source itself, run on a CPU simulator (tests/rlt-decode/cuda_sim) ----------------------------------
SIM_DIR = Path(__file__).parent / "cuda_sim"
SIM_STAGES = 4  # a short ring: the producer wraps around it many times a layer


@pytest.fixture(scope="module", params=[(4, 0), (8, 5)], ids=lambda p: f"{p[0]}warps-l2ahead{p[1]}")
def cuda_sim(request, tmp_path_factory):
    """loop_kernel.cu compiled for the CPU with cuda_cpu_sim.h (g++, C++20: std::barrier), at 4 consumer warps and
    at 8 with the producer's L2 prefetches 5 stages ahead and 16 early V rows: (the library, its consumer warps)."""
    from rlt.decode.persistent import cuda

    gxx = shutil.which("g++")
    assert gxx, "g++ not found: the CPU simulator of the loop kernel needs a C++20 compiler"
    lib = tmp_path_factory.mktemp("cuda_sim") / "libouro_loop_sim.so"
    cmd = [gxx, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w", "-DRLT_CPU_SIM", f"-DNSTAGES={SIM_STAGES}",
           f"-DCONSUMER_WARPS={request.param[0]}", f"-DL2_AHEAD={request.param[1]}",
           f"-DV_EARLY={16 if request.param[1] else 0}",
           "-DWATCHDOG_NS=120000000000ull", f"-I{cuda.HERE}", f"-I{SIM_DIR}", str(SIM_DIR / "launch.cpp"),
           "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return str(lib), request.param[0]


def _sim_launch(lib: str, args_bytes: bytes, ctas: int, smem: int) -> None:  # in a child process: an abort stays there
    import ctypes as ct

    from rlt.decode.persistent.cuda import LoopArgs

    rc = ct.CDLL(lib).sim_ouro_loop(ct.byref(LoopArgs.from_buffer_copy(args_bytes)), ctas, ct.c_ulong(smem))
    if rc:  # (launch.cpp: the L2 prefetches did not name the stages the ring loaded)
        os._exit(10 + rc)


@pytest.mark.parametrize("ctas,context", [(3, 37), (5, 1), (9, 60), (17, 200)])
def test_the_cuda_source_runs_on_a_cpu_simulator(cuda_sim, ctas, context):
    """loop_kernel.cu's own source, every CUDA thread an OS thread (mbarriers, bulk copies, named and grid barriers
    simulated): 3 CTAs for 4 heads (a CTA takes two attention items), one key (every split but the last empty),
    two and four context splits a head. Its output is as close to the fp32 arithmetic as the kernel-per-op bf16
    path (measured: the same distance, 7.4e-3 to 1.07e-2, in all four; bit-equal to the emulated plan in two, the
    others a rounding flip apart), every CTA passed every grid barrier, and it wrote K/V only at the token's slot,
    every layer (layer 0's rows as the plan computes them)."""
    import multiprocessing

    from rlt.decode.persistent import cuda

    model, kv, meta, hidden, slot = _setup(torch.bfloat16, 2, context)
    nkv, L = model.cfg.num_key_value_heads, len(model.layers)
    cos, sin = (t[0].contiguous() for t in model.rotary(meta.positions))
    slots = key_slots(kv, meta, context)[0].to(torch.int32).contiguous()
    lw = loop.pack(model)
    splits = loop.splits_for(model.cfg.num_attention_heads, ctas)
    bufs = cuda.loop_scratch(model, splits, "cpu")
    out = torch.zeros_like(hidden)
    k0, v0 = kv.k.clone(), kv.v.clone()
    times = torch.zeros(ctas * (L * loop.STAMPS + 4), dtype=torch.int64)
    for t in (out, kv.k, kv.v, times, *bufs.values()):
        t.share_memory_()  # the child process writes them
    args = cuda.loop_args(model, lw, bufs, splits, L, hidden, out, cos, sin, kv.k, kv.v, slots,
                          meta.slot_mapping[:1], meta.seq_lens[:1], times)
    lib, warps = cuda_sim
    child = multiprocessing.get_context("fork").Process(
        target=_sim_launch, args=(lib, bytes(args), ctas, cuda.loop_shared_bytes(SIM_STAGES, warps)))
    child.start()
    child.join(240)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, f"the simulated kernel did not finish (exit code {child.exitcode})"
    assert bufs["counter"][0].item() == L * 5 * ctas  # five grid barriers a layer, every CTA
    assert (bufs["counter"][1:] == L * splits).all()  # every head: its splits' partials, every layer
    stamps = times[:ctas * L * loop.STAMPS].view(ctas, L, loop.STAMPS)  # (the probe's phase breakdown)
    ends = times[ctas * L * loop.STAMPS:].view(ctas, 4)
    assert (stamps[..., :15] > 0).all() and (stamps[..., 15] == 0).all()
    flat = torch.cat([ends[:, 1:2], stamps[..., :15].reshape(ctas, -1), ends[:, 3:]], 1)
    assert (flat.diff(dim=1) >= 0).all() and (ends[:, 2] >= ends[:, 0]).all()

    written = [(new != old).view(L, -1, nkv * 128).any(-1) for new, old in ((kv.k, k0), (kv.v, v0))]
    assert all(w[:, slot].all() and w.sum().item() == L for w in written)
    k_em, v_em = k0.clone(), v0.clone()
    plan_out = loop.emulate(model, lw, hidden, cos, sin, k_em.view(L, -1, nkv, 128), v_em.view(L, -1, nkv, 128), slots,
                            slot, context, ctas)
    assert (kv.k[0] - k_em[0]).abs().max().item() <= 1e-2 * k_em[0].abs().max().item()
    assert (kv.v[0] - v_em[0]).abs().max().item() <= 1e-2 * v_em[0].abs().max().item()

    oracle = _fp32(model, 0, hidden, kv, meta)  # (the slot the kernel wrote is written again by each step)
    ref = model.recurrent(hidden[None], model.rotary(meta.positions), kv, TorchReferenceBackend(), meta)[0]
    rel = lambda a: ((a.float() - oracle).abs().max() / oracle.abs().max()).item()
    print(f"ctas={ctas} context={context}: vs fp32 kernel {rel(out):.2e}, plan {rel(plan_out):.2e}, "
          f"kernel-per-op {rel(ref):.2e}; kernel == plan: {torch.equal(out.float(), plan_out)}")
    assert rel(out) <= 2 * rel(ref) + 1e-3
