"""Compiling and launching the persistent kernels: NVRTC (or nvcc) to a sm_90a cubin, the CUDA driver API
(ctypes) to load and launch it on PyTorch's current stream, and the loop kernel's argument block.

The kernels use Hopper's bulk copies and mbarriers (``cp.async.bulk``), so they need an NVIDIA GPU of
compute capability 9.0 or newer; the sources (``*.cu``, ``persistent.cuh``) ship next to this module.
PyTorch's CUDA wheels bring ``libnvrtc``; without it, ``nvcc`` on the PATH is used.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from rlt.decode.persistent.plan import (CONSUMER_WARPS, HEAD_DIM, L2_AHEAD, MAX_H, MAX_K, ROWS, STAGE_ELEMS, STAMPS,
                                        V_EARLY, LoopWeights, splits_for)

HERE = Path(__file__).parent
LOOP_SOURCE = HERE / "loop_kernel.cu"


def find_nvrtc(explicit: str = "") -> str | None:
    """A libnvrtc: ``explicit``, else one of the NVIDIA wheels on ``sys.path`` (PyTorch's CUDA wheels bring it),
    else the CUDA toolkit's; None when there is none."""
    if explicit:
        return explicit
    roots = [Path(p) for p in sys.path if p and Path(p).is_dir()]
    for root in roots:
        for pat in ("nvidia/*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*", "torch/lib/libnvrtc*.so*"):
            hits = sorted(h for h in glob.glob(str(root / pat)) if "builtins" not in h and ".alt." not in h)
            if hits:
                return hits[0]
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
        hits = sorted(h for h in glob.glob(f"{d}/libnvrtc.so*") if "builtins" not in h and ".alt." not in h)
        if hits:
            return hits[0]
    return None


def nvrtc_compile(lib: str, defines: dict[str, int], source: Path, arch: str = "sm_90a",
                  verbose: bool = False) -> tuple[bytes, str]:
    """(cubin, compile log) of ``source`` through the libnvrtc at ``lib``; ``verbose``: ptxas's resource
    report (registers, spills, stack) in the log."""
    nvrtc = ctypes.CDLL(lib)
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()

    def ok(rc, what):
        if rc:
            raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(rc).decode()}")

    ok(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None),
       "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"--include-path={source.parent}".encode(),
                f"--include-path={HERE}".encode()] + [f"-D{k}={v}".encode() for k, v in defines.items()]
        if verbose:
            opts.append(b"--ptxas-options=-v")
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if rc:
            raise RuntimeError(f"nvrtc compile failed:\n{text}")
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, text
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_nvrtc(lib: str, defines: dict[str, int], source: Path, arch: str = "sm_90a") -> bytes:
    return nvrtc_compile(lib, defines, source, arch)[0]


def compile_nvcc(nvcc: str, defines: dict[str, int], source: Path, arch: str = "sm_90a") -> bytes:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "k.cubin"
        cmd = [nvcc, "-cubin", f"-gencode=arch={arch.replace('sm', 'compute')},code={arch}", "-O3", "-std=c++17",
               "-Xptxas", "-v", f"-I{source.parent}", f"-I{HERE}", *(f"-D{k}={v}" for k, v in defines.items()),
               "-o", str(out), str(source)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed:\n{r.stderr}")
        print(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "", file=sys.stderr)
        return out.read_bytes()


def build(source: Path, defines: dict[str, int], nvrtc: str = "") -> bytes:
    """The cubin of ``source`` for sm_90a: NVRTC where a libnvrtc is found (``nvrtc``: its path), else (or when
    it fails) nvcc."""
    errors = []
    lib = find_nvrtc(nvrtc)
    if lib:
        try:
            return compile_nvrtc(lib, defines, source)
        except (OSError, RuntimeError) as exc:
            errors.append(f"{lib}: {exc}")
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc:
        try:
            return compile_nvcc(nvcc, defines, source)
        except RuntimeError as exc:
            errors.append(f"{nvcc}: {exc}")
    raise RuntimeError("; ".join(errors) or "neither libnvrtc nor nvcc found (--nvrtc PATH)")


class Kernel:
    """The cubin's kernel ``name``, launched with the CUDA driver API on PyTorch's current stream (so a
    CUDA graph being captured there records the launch)."""

    def __init__(self, cubin: bytes, smem: int, name: str) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.smem = smem
        self.mod, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._ok(self.cu.cuModuleLoadData(ctypes.byref(self.mod), cubin), "cuModuleLoadData")
        self._ok(self.cu.cuModuleGetFunction(ctypes.byref(self.fn), self.mod, name.encode()), "cuModuleGetFunction")
        # 8: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._ok(self.cu.cuFuncSetAttribute(self.fn, 8, smem), "cuFuncSetAttribute(max dynamic shared)")
        regs = ctypes.c_int()
        self.cu.cuFuncGetAttribute(ctypes.byref(regs), 4, self.fn)  # 4: NUM_REGS
        self.regs = regs.value

    def _ok(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: CUDA error {rc} {name.value.decode() if name.value else ''}")

    def launch(self, ctas: int, threads: int, args: list) -> None:
        """One launch of ``ctas`` x ``threads`` with ``args`` (ctypes values, in the kernel's parameter order)."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.cu.cuLaunchKernel(self.fn, ctas, 1, 1, threads, 1, 1, self.smem, stream, params, None),
                 "cuLaunchKernel")


class LoopArgs(ctypes.Structure):
    """``loop_kernel.cu``'s ``LoopArgs``, field for field."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("w", "norms", "final_norm", "hidden_in", "out", "cos", "sin", "k_cache",
                                               "v_cache")] + [("layer_stride", ctypes.c_longlong)] + \
               [(n, ctypes.c_void_p) for n in ("slots", "write_slot", "seq_len", "qkv", "part", "o", "o_out", "hres",
                                               "act", "down", "counter", "times")] + \
               [(n, ctypes.c_int) for n in ("hidden", "inter", "layers", "nq", "nkv", "splits")] + \
               [("eps", ctypes.c_float), ("scale_log2", ctypes.c_float)]


def loop_shared_bytes(stages: int, consumer_warps: int = CONSUMER_WARPS) -> int:
    """Dynamic shared memory of ``loop_kernel.cu``: the ring, the phase input, row sums, reduction scratch,
    two mbarriers a stage."""
    return stages * STAGE_ELEMS * 2 + (MAX_K + ROWS + consumer_warps) * 4 + stages * 16


def loop_scratch(model, splits: int, device) -> dict[str, torch.Tensor]:
    """The kernel's global scratch for ``model`` at ``splits`` context splits a head (``LoopArgs``' float buffers,
    and the grid barrier's counter, zeroed before each launch)."""
    cfg = model.cfg
    nq, nkv, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    sizes = dict(qkv=(nq + 2 * nkv) * HEAD_DIM, part=nq * splits * (HEAD_DIM + 2), o=nq * HEAD_DIM, o_out=H,
                 hres=2 * H, act=cfg.intermediate_size, down=H)
    bufs = {name: torch.zeros(n, device=device) for name, n in sizes.items()}
    bufs["counter"] = torch.zeros(1 + nq, dtype=torch.int32, device=device)  # the grid barrier's, then a head's
    return bufs


def loop_args(model, lw: LoopWeights, bufs: dict[str, torch.Tensor], splits: int, layers: int, hidden, out, cos, sin,
              k_cache, v_cache, slots, write_slot, seq_len, times: torch.Tensor | None = None) -> LoopArgs:
    """``LoopArgs`` of one launch (tensors by address: those of a captured graph's buffers replay with new values);
    ``times``: int64 ``[ctas * (layers * STAMPS + 4)]`` for the phase stamps (None: none taken)."""
    cfg = model.cfg
    p = lambda t: ctypes.c_void_p(t.data_ptr())
    return LoopArgs(p(lw.packed), p(lw.norms), p(lw.final_norm), p(hidden), p(out), p(cos), p(sin), p(k_cache),
                    p(v_cache), k_cache.stride(0), p(slots), p(write_slot), p(seq_len),
                    *(p(bufs[n]) for n in ("qkv", "part", "o", "o_out", "hres", "act", "down", "counter")),
                    ctypes.c_void_p(times.data_ptr() if times is not None else None),
                    cfg.hidden_size, cfg.intermediate_size, layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                    splits, cfg.rms_norm_eps, HEAD_DIM ** -0.5 * math.log2(math.e))


class CudaLoop:
    """The compiled loop kernel with its scratch buffers, for one model (bf16, one CTA per SM;
    ``consumer_warps``: 4 or 8 consumer warps a CTA; ``l2_ahead``: stages of its next phase the producer
    prefetches into L2 as it starts a phase, 0: none; ``v_early``: V rows of a key block loaded with its K rows)."""

    kind = "cuda"

    def __init__(self, model, lw: LoopWeights, stages: int = 12, ctas: int | None = None, nvrtc: str = "",
                 consumer_warps: int = CONSUMER_WARPS, l2_ahead: int = L2_AHEAD, v_early: int = V_EARLY) -> None:
        if consumer_warps not in (4, 8):
            raise ValueError(f"consumer_warps {consumer_warps}: the kernel splits a stage's 16 rows over 4 or 8 warps")
        dev = lw.packed.device
        self.model, self.lw = model, lw
        self.ctas = ctas or torch.cuda.get_device_properties(dev).multi_processor_count
        self.stages, self.threads = stages, 32 * (1 + consumer_warps)
        # (the sizes check_model and loop_shared_bytes assume, so that the kernel cannot disagree with them)
        defines = {"NSTAGES": stages, "CONSUMER_WARPS": consumer_warps, "L2_AHEAD": l2_ahead, "V_EARLY": v_early,
                   "MAX_H": MAX_H, "MAX_K": MAX_K, "STAMPS": STAMPS}
        self.kernel = Kernel(build(LOOP_SOURCE, defines, nvrtc), loop_shared_bytes(stages, consumer_warps), "ouro_loop")
        self.splits = splits_for(model.cfg.num_attention_heads, self.ctas)
        #: layers a launch runs (all of the model's; a probe's diagnosis runs the first alone)
        self.layers = len(model.layers)
        self.bufs = loop_scratch(model, self.splits, dev)
        #: int64 phase stamps of the next launches when set (``loop_args``' ``times``; the probe's breakdown)
        self.times: torch.Tensor | None = None

    def __call__(self, hidden, out, cos, sin, k_cache, v_cache, slots, write_slot, seq_len) -> None:
        """One loop step: ``hidden`` / ``out`` ``[H]`` bf16; cos / sin ``[HEAD_DIM]``; the caches ``[L, blocks,
        block_size, nkv, d]``; ``slots`` int32 resolved key slots; ``write_slot`` int64 ``[1]``; ``seq_len``
        int32 ``[1]`` (device tensors, so that a graph replays the launch with new values)."""
        self.bufs["counter"].zero_()
        args = loop_args(self.model, self.lw, self.bufs, self.splits, self.layers, hidden, out, cos, sin, k_cache,
                         v_cache, slots, write_slot, seq_len, self.times)
        self.kernel.launch(self.ctas, self.threads, [args])
