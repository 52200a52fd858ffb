"""``triton``: paged, depth-aware attention kernels in Triton (CUDA and ROCm).

This module owns the host side of the Triton backend: which kernel serves which rows, tile sizes,
split counts, and the preallocated split-KV scratch. The kernels live in
:mod:`rlt.attention.backends.triton_kernels` and are imported on first use (so the registry and
the selector can read :attr:`TritonBackend.spec` without importing Triton).

Dispatch, decided only from shapes and the metadata's host-side bounds (never from device data,
so a step can be captured in a graph and replayed):

* ``max_query_len <= 1`` — pure decode: :func:`decode_grouped_kernel` by default (one KV head per
  program, the group's query heads — one for MHA, padded to 16 — through ``tl.dot``, which Triton
  software-pipelines with cp.async; measured faster on the H200 than the MMA-free
  :func:`decode_kernel`, which ``decode_variant="elementwise"`` selects). When rows x head programs
  are too few to fill the device, the KV range of each row is split (flash-decoding; split count a
  run-time argument) and a merge kernel combines the partials — or, with ``rlt.attention.fold`` on, the
  decode program that stores a row's last partial combines them (no merge launch).
* otherwise — :func:`prefill_kernel` for the multi-token rows; when the batch has several rows the
  decode kernel runs too and takes the rows of query length 1 (each kernel skips the other's rows
  on the device), so a mixed prefill + decode batch gets the right kernel per row.

Both read LAST_EXITED history through ``kv.token_depth`` (``min(query depth, stamped depth)``,
then that plane's page table) and SHARED from plane 0; nothing is copied. The plane lookup is a
chain of three dependent loads per key tile; with ``pre_resolve_*`` a small pre-pass kernel
(:func:`resolve_slots_kernel`) first writes each row's resolved slot list (``rows x max_seq_len``
int32, a few hundred KB) so the attention loop does one index load per tile. The list depends only
on the step's page tables and version map, which no layer changes (a step stamps its tokens'
depths before its first layer), so :meth:`TritonBackend.prepare` resolves it once per step into
``meta.resolved_slots`` for every layer (inside the captured graph, so a replay re-resolves);
``forward`` resolves per call only when it gets metadata that did not pass through ``prepare``.

Precision: ``dot_precision`` is the fp32 ``tl.dot`` precision the platform allows ("tf32" on
NVIDIA, "ieee" on ROCm, which rejects "tf32"). The numerics contract (ARCHITECTURE §5) requires
fp32 paths to be token-identical to the fp32 oracle, so fp32 inputs use "ieee" unless
``exact_fp32=False`` opts into the platform's faster precision. bf16/fp16 dots ignore the
setting (bf16 operands, fp32 accumulation, fp32 softmax).

Defaults were chosen on the H200 (benchmarks/attention_bench.py --sweep, results in
benchmarks/results/): grouped decode with 64-key tiles and pre-resolved slots; split decode with
32-key tiles, 3 stages, ~4 programs per SM, splits of >= 32 keys; prefill 128x128 tiles, 8 warps, 3 stages, pre-resolved (fp32: 128x64; any choice is clamped to
the shared memory a program may use, see :func:`prefill_shared_bytes`).

Graph safety: no host synchronisation, no data-dependent Python, split scratch cached per shape
(allocate it by running each bucket once before capture, as with any Triton kernel's JIT).
"""

from __future__ import annotations

import functools
import os

import attrs
import torch

from rlt.attention.backend import AttentionBackend, BackendSpec, dense_prefill_switch
from rlt.attention.kv_cache import KVCache, KVLayout, RowScatter, portable_row_scatter
from rlt.attention.metadata import AttentionMetadata
from rlt.attention.fold import fold_enabled
from rlt.attention.pdl import kernel_options

_LOG2E = 1.4426950408889634
#: Most KV splits per row (the automatic policy also keeps >= ``min_keys_per_split`` keys per split).
MAX_SPLITS = 64
#: Dynamic shared memory one program may use (Hopper/Ampere opt-in maximum: 227 KiB).
SHARED_MEMORY_BYTES = 227 * 1024


def prefill_shared_bytes(block_m: int, block_n: int, num_stages: int, block_d: int, elem: int) -> int:
    """Shared memory of the prefill kernel as Triton 3.6 allocates it for sm_90 (fitted to the
    compiler's numbers, benchmarks/triton_aot_report.py): K and V tiles in ``num_stages - 1``
    pipeline buffers, plus the Q tile on the 16-bit MMA path, or (fp32 FMA path) a P-tile layout
    conversion buffer. Exact for bf16 128x128x3 and fp32 128x64x3; an upper bound otherwise."""
    kv = (num_stages - 1) * 2 * block_n * block_d * elem
    extra = block_m * block_d * elem if elem < 4 else block_m * block_n * elem
    return kv + extra + 1024


def _fit_shared(block_m: int, block_n: int, num_stages: int, block_d: int, elem: int) -> tuple[int, int]:
    while prefill_shared_bytes(block_m, block_n, num_stages, block_d, elem) > SHARED_MEMORY_BYTES:
        if num_stages > 2:
            num_stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return block_n, num_stages


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the split policies of the Triton kernels, here and in
    ``rlt.platform.models.fused_linear``); under the interpreter a small pretend device of 16, so the
    split paths are exercised on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16


def _has_tma(device: torch.device) -> bool:
    """Whether kernels on ``device`` can load through TMA descriptors: CUDA sm_90+ (not HIP; asked once per
    device), or Triton's interpreter on CPU (tests)."""
    if device.type == "cuda":
        return _cuda_has_tma(device)
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _cuda_has_tma(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _tensor_descriptor():
    """Triton's host-side TMA descriptor class (Triton >= 3.3), imported on first use like the kernels;
    None without it (the dense prefill path then stays off)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def tma_ready(t: torch.Tensor) -> bool:
    """Whether Triton kernels may load the 2-D tensor ``t`` through a TMA descriptor (its rows contiguous,
    row stride and base 16-byte aligned, on a device with TMA; also ``rlt.platform.models.fused_linear``)."""
    return (_tensor_descriptor() is not None and _has_tma(t.device) and t.dim() == 2 and t.stride(-1) == 1
            and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0)


def tma_descriptor(t: torch.Tensor, box: list[int]):
    """The host-side TMA descriptor of the 2-D tensor ``t`` (:func:`tma_ready`) with ``box``-shaped loads;
    loads past its shape read zeros."""
    return _tensor_descriptor()(t, list(t.shape), [t.stride(0), 1], box)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@attrs.frozen
class DecodeTiles:
    """Decode tile shape: keys per inner iteration, warps per program, software-pipeline depth; and the grid
    order (``heads_fastest``: the head programs of a row launch together, see
    :mod:`rlt.attention.backends.triton_kernels.paged_decode`)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    heads_fastest: bool = False


def decode_tiles_from_env(spec: str) -> dict[str, DecodeTiles]:
    """``RLT_DECODE_TILES`` (for sweeps): comma-separated ``KIND=BNxWARPSxSTAGES[xH]`` with KIND ``decode`` (one
    split) or ``split`` (split-KV), ``H`` 1 for the heads-fastest grid; returns the constructor's keyword
    arguments (``decode_tiles`` / ``split_decode_tiles``) for the kinds named."""
    out: dict[str, DecodeTiles] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, _, shape = entry.partition("=")
        parts = shape.split("x")
        if kind not in ("decode", "split") or len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
            raise ValueError(f"RLT_DECODE_TILES entry {entry!r}: expected decode=BNxWARPSxSTAGES[xH] or "
                             "split=BNxWARPSxSTAGES[xH] (H: 1 for the heads-fastest grid)")
        bn, warps, stages, *h = (int(p) for p in parts)
        key = "decode_tiles" if kind == "decode" else "split_decode_tiles"
        out[key] = DecodeTiles(block_n=bn, num_warps=warps, num_stages=stages, heads_fastest=bool(h and h[0]))
    return out


@attrs.frozen
class PrefillTiles:
    """Prefill tile shape upper bounds: ``block_m`` query rows (tokens x packed heads), ``block_n`` keys;
    and the kernel variants (see :mod:`rlt.attention.backends.triton_kernels.paged_prefill`):
    ``heads_fastest`` grid order, ``one_loop`` (one key loop: no wgmma serialization on sm_90),
    ``k_natural`` K tile layout, ``fma_scale``, ``dot_acc``, ``lazy_rescale`` (16-bit inputs only:
    fp32 keeps the eager rescale of the exact path)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    # Defaults: one key loop (no ptxas wgmma serialisation on sm_90), heads-fastest grid (global
    # longest-first order), the scale folded into the exponent, PV accumulated in the MMA. Chosen
    # from sm_90 SASS and reasoning before an H200 sweep (benchmarks/prefill_kernel_sweep.py);
    # revert this commit to return to the old kernel.
    heads_fastest: bool = True
    k_natural: bool = False
    fma_scale: bool = True
    dot_acc: bool = True
    lazy_rescale: bool = False
    one_loop: bool = True

    def variant_flags(self, elem: int) -> dict:
        """The kernel's variant constexprs for inputs of ``elem`` bytes."""
        return dict(HEADS_FASTEST=self.heads_fastest, K_NATURAL=self.k_natural, FMA_SCALE=self.fma_scale,
                    DOT_ACC=self.dot_acc, LAZY_RESCALE=self.lazy_rescale and elem < 4, ONE_LOOP=self.one_loop)


class TritonBackend(AttentionBackend):
    name = "triton"
    spec = BackendSpec(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dims=frozenset(range(8, 257, 8)),
        block_size_multiple=1,
        packed_prefill=True,
        graph_safe=True,
    )

    def __init__(
        self,
        *,
        dot_precision: str = "ieee",
        exact_fp32: bool = True,
        decode_tiles: DecodeTiles | None = None,
        split_decode_tiles: DecodeTiles | None = None,
        prefill_tiles: PrefillTiles = PrefillTiles(),
        fp32_prefill_tiles: PrefillTiles = PrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=3),
        pre_resolve_decode: bool = True,
        pre_resolve_prefill: bool = True,
        decode_variant: str = "auto",
        num_splits: int | None = None,
        min_keys_per_split: int = 32,
        fused_kv_write: bool = True,
        poison_output: bool = False,
        dense_prefill: bool | None = None,
        scatter: RowScatter = portable_row_scatter,
    ) -> None:
        super().__init__(scatter=scatter)
        #: Fresh prompt rows read their keys densely through TMA (``triton_kernels.dense_prefill``) when the
        #: model passes the step's K/V; None: on unless ``RLT_DENSE_PREFILL=0`` (H200, 8K: 74 % of the matmul
        #: rate vs 49 % paged; 8K prefill 43.3K vs 38.6K tok/s — benchmarks/results/h200-20261205-lease8).
        self.takes_new_kv = dense_prefill_switch(True) if dense_prefill is None else dense_prefill
        if decode_variant not in ("auto", "elementwise", "grouped"):
            raise ValueError(f"decode_variant must be auto, elementwise or grouped, got {decode_variant!r}")
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
        self.dot_precision = dot_precision
        self.exact_fp32 = exact_fp32
        env_tiles = decode_tiles_from_env(os.environ.get("RLT_DECODE_TILES", ""))
        #: One-split decode: 3 stages and the heads-fastest grid (lease 13, an H100: 64 rows x 1K 186.0 -> 183.8 us per
        #: layer, 128 rows 369.8 -> 352.5; C=64 decode +0.9 % in both orders; C=1 uses the split tiles below).
        self.decode_tiles = decode_tiles or env_tiles.get("decode_tiles", DecodeTiles(num_stages=3, heads_fastest=True))
        self.split_decode_tiles = split_decode_tiles or env_tiles.get(
            "split_decode_tiles", DecodeTiles(block_n=32, num_warps=4, num_stages=3))
        self.pre_resolve_decode = pre_resolve_decode
        self.pre_resolve_prefill = pre_resolve_prefill
        self.prefill_tiles = prefill_tiles
        #: fp32 (exact, FMA dots) keeps K/V tiles in fp32 and no Q tile: 128x128 would need 263 KB.
        self.fp32_prefill_tiles = fp32_prefill_tiles
        self.decode_variant = decode_variant
        self.num_splits = num_splits
        self.min_keys_per_split = min_keys_per_split
        self.fused_kv_write = fused_kv_write
        #: Debug/test aid: fill the output and split scratch with NaN before the kernels run, so a
        #: result that passes proves every element was written (costs a fill; off in serving).
        self.poison_output = poison_output
        self._kernels = None
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def describe(self) -> str:
        return f"triton (fp32 dots: {'ieee' if self.exact_fp32 else self.dot_precision})"

    # -- helpers ---------------------------------------------------------------------------------
    def _k(self):
        if self._kernels is None:
            from rlt.attention.backends.triton_kernels import kv_write, paged_decode, paged_prefill

            self._kernels = (paged_decode, paged_prefill, kv_write)
        return self._kernels

    @staticmethod
    def _check_device(t: torch.Tensor) -> None:
        if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "the triton attention backend runs on CUDA/ROCm tensors; on CPU use the torch backend "
                "(or set TRITON_INTERPRET=1 before importing Triton, as the tests do)"
            )

    def splits_for(self, rows: int, head_programs: int, max_seq_len: int, device: torch.device) -> int:
        """KV splits per row: enough programs for ~4 per SM, each split >= ``min_keys_per_split`` keys.

        Depends only on the batch shape and the host-side length bound; the kernels divide the
        actual (device) length among the splits, so any split count is correct. Chosen on the H200
        (``benchmarks/decode_kernels.py``, 2026-12-04, 16 KV heads, per layer): 1 row x 1K keys
        8.7 us with 32 splits of 32 keys against 17.3 us with 4 splits of 256 (the previous
        policy); 1 x 4K 15.2 (32 splits) vs 20.1; 8 x 1K 27.6 (4 splits) vs 30.2; 64 rows need none.
        """
        if self.num_splits is not None:
            return self.num_splits
        programs = max(1, rows * head_programs)
        sms = num_sms(device)
        if programs >= 2 * sms:
            return 1
        want = -(-4 * sms // programs)
        by_len = max(1, -(-max(int(max_seq_len), 1) // self.min_keys_per_split))
        return max(1, min(want, by_len, MAX_SPLITS))

    def _split_scratch(self, rows: int, heads: int, splits: int, head_dim: int, device: torch.device):
        # One buffer per shape, shared by every call (and every captured graph) of that shape: safe because the
        # engine runs its attention calls on one stream. Calls of one shape on concurrent streams would overwrite
        # each other's partial sums (measured: benchmarks/row_split_overlap.py's parallel groups, lease 16).
        key = (device, rows, heads, splits, head_dim)
        buf = self._scratch.get(key)
        if buf is None:
            acc = torch.empty(rows * heads * splits * head_dim, dtype=torch.float32, device=device)
            ml = torch.empty(rows * heads * splits * 2, dtype=torch.float32, device=device)
            # the folded merge's ticket counters: zero, and zero again after every launch (never poisoned)
            counters = torch.zeros(rows * heads, dtype=torch.int32, device=device)
            buf = self._scratch[key] = (acc, ml, counters)
        if self.poison_output:
            buf[0].fill_(float("nan"))
            buf[1].fill_(float("nan"))
        return buf

    # -- KV write --------------------------------------------------------------------------------
    def write_kv(
        self, kv: KVCache, layer: int, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        n, nkv, d = key.shape
        row = nkv * d
        fusable = all(t.stride(-1) == 1 and t.stride(-2) == d for t in (key, value))
        if not self.fused_kv_write or not fusable or n == 0:
            return super().write_kv(kv, layer, key, value, meta)
        self._check_device(key)
        _, _, kv_write = self._k()
        block = min(_next_pow2(row), 4096)
        kv_write.write_kv_kernel[(n, -(-row // block))](
            kv.k[layer], kv.v[layer], key, value, meta.slot_mapping,
            key.stride(0), value.stride(0), ROW=row, BLOCK=block,
        )

    # -- attention -------------------------------------------------------------------------------
    @staticmethod
    def _tables(meta: AttentionMetadata) -> torch.Tensor:
        bt = meta.block_tables
        if bt.dtype != torch.int32 or bt.stride(-1) != 1:
            bt = bt.to(torch.int32).contiguous()
        return bt

    def _pre_resolves(self, kv: KVCache, meta: AttentionMetadata) -> bool:
        """Whether a pre-pass resolves key slots (LAST_EXITED only: SHARED is one load anyway)."""
        want = self.pre_resolve_decode if meta.max_query_len <= 1 else (self.pre_resolve_prefill or self.pre_resolve_decode)
        k = kv.k[0]
        return (want and kv.layout is KVLayout.LAST_EXITED and kv.token_depth is not None
                and k.stride(0) == kv.block_size * k.stride(1))

    def _resolve(self, kv: KVCache, meta: AttentionMetadata, bt: torch.Tensor) -> torch.Tensor:
        rows = meta.seq_lens.shape[0]
        num_planes = min(kv.num_planes, bt.shape[1])
        slots = torch.empty((rows, max(int(meta.max_seq_len), 1)), dtype=torch.int32, device=meta.seq_lens.device)
        if rows:
            self._paging().resolve_slots_kernel[(rows, -(-slots.shape[1] // 1024))](
                slots, bt, kv.token_depth, meta.seq_lens, meta.query_depth, slots.stride(0), bt.stride(0),
                bt.stride(1), num_planes, BLOCK_SIZE=kv.block_size, LAST_EXITED=True, BLOCK=1024, num_warps=4,
            )
        return slots

    def prepare(self, kv: KVCache, meta: AttentionMetadata) -> AttentionMetadata:
        if meta.resolved_slots is not None or not self._pre_resolves(kv, meta):
            return meta
        self._check_device(meta.seq_lens)
        return attrs.evolve(meta, resolved_slots=self._resolve(kv, meta, self._tables(meta)))

    def forward(
        self, query: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata, scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        n, nh, d = query.shape
        if n == 0:
            return query.new_empty((0, nh * d))
        self._check_device(query)
        if query.dtype != kv.k.dtype:
            raise ValueError(f"query dtype {query.dtype} != KV cache dtype {kv.k.dtype}")
        paged_decode, paged_prefill, _ = self._k()
        q = query if query.stride(-1) == 1 else query.contiguous()
        k, v = kv.k[layer], kv.v[layer]  # [blocks, block_size, kv_heads, d]
        if k.stride() != v.stride() or k.stride(-1) != 1:
            raise ValueError("the K and V caches must share one layout with a contiguous head_dim (KVCache.allocate)")
        nkv = k.shape[2]
        group = nh // nkv
        rows = meta.seq_lens.shape[0]
        bt = self._tables(meta)
        last_exited = kv.layout is KVLayout.LAST_EXITED and kv.token_depth is not None
        td = kv.token_depth if last_exited else meta.seq_lens  # unused pointer under SHARED
        num_planes = min(kv.num_planes, bt.shape[1])
        precision = "ieee" if (query.dtype == torch.float32 and self.exact_fp32) else self.dot_precision
        out = torch.empty((n, nh * d), dtype=query.dtype, device=query.device)
        if self.poison_output:
            out.fill_(float("nan"))
        block_d = max(16, _next_pow2(d))
        pure_decode = meta.max_query_len <= 1
        pre = self._pre_resolves(kv, meta)
        if pre:  # resolved once per step by prepare(), or here for metadata that skipped it
            slots = meta.resolved_slots if meta.resolved_slots is not None else self._resolve(kv, meta, bt)
        else:
            slots = meta.seq_lens  # unused pointer
        common = (
            bt, td, slots, meta.seq_lens, meta.query_depth, meta.query_start_loc, scale * _LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), out.stride(0),
            bt.stride(0), bt.stride(1), slots.stride(0), num_planes,
        )
        flags = dict(last_exited=last_exited, pre=pre)
        if pure_decode or rows > 1:
            self._decode(paged_decode, q, k, v, out, common, rows, nh, nkv, group, d, block_d, kv.block_size,
                         precision, meta.max_seq_len, **flags)
        if not pure_decode:
            dense = new_kv is not None and self.takes_new_kv and self._dense_ready(q, new_kv, k)
            if dense:
                self._dense_prefill(q, new_kv, out, meta, rows, group, d, precision, scale, skip_single=rows > 1)
            if not (dense and meta.fresh):  # every row fresh (host-known): no paged program would do any work
                self._prefill(paged_prefill, q, k, v, out, common, rows, nkv, group, d, block_d, kv.block_size,
                              precision, meta.max_query_len, skip_single=rows > 1, last_exited=last_exited, pre=pre,
                              skip_fresh=dense)
        return out

    @staticmethod
    def _dense_ready(q: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor) -> bool:
        """Whether the dense TMA path can read this step's K/V: Triton's host-side tensor descriptors exist,
        the device has TMA (CUDA sm_90+; or the interpreter), the values are the cache's (same dtype), and
        every 2-D view ``[tokens, heads * head_dim]`` has a contiguous head_dim, 16-byte aligned rows and
        base, and a power-of-two head_dim of 16 to 256 (one TMA box; ``tl.dot`` needs K >= 16 on the GPU, which
        the interpreter does not check: head_dim 8 failed to compile on the H200, lease 9 — the paged kernel
        pads head_dim to 16 instead)."""
        if _tensor_descriptor() is None or not _has_tma(q.device):
            return False
        d = q.shape[2]
        if d & (d - 1) or not 16 <= d <= 256:
            return False
        for t in (q, *new_kv):
            if t.dtype != cache.dtype or t.dim() != 3 or t.shape[2] != d or t.stride(2) != 1 or t.stride(1) != d:
                return False
            if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
                return False
        return new_kv[0].shape == new_kv[1].shape and new_kv[0].shape[0] == q.shape[0]

    def _dense_prefill(self, q, new_kv, out, meta, rows, group, d, precision, scale, skip_single):
        from rlt.attention.backends.triton_kernels.dense_prefill import dense_prefill_kernel

        elem = q.element_size()
        tiles = self.fp32_prefill_tiles if elem == 4 else self.prefill_tiles
        block_m = min(tiles.block_m, max(16, _next_pow2(meta.max_query_len)))
        block_n, num_stages = _fit_shared(block_m, tiles.block_n, tiles.num_stages, d, elem)
        block_n = min(block_n, block_m) if block_m < 64 else block_n
        n, nh = q.shape[0], q.shape[1]

        def desc(t: torch.Tensor, box_rows: int):
            return _tensor_descriptor()(t, [t.shape[0], t.shape[1] * d], [t.stride(0), 1], [box_rows, d])

        variant = tiles.variant_flags(elem)
        dense_prefill_kernel[(nh, n // block_m + rows)](
            desc(q, block_m), desc(new_kv[0], block_n), desc(new_kv[1], block_n), out, meta.seq_lens,
            meta.query_start_loc, scale * _LOG2E, out.stride(0), rows,
            GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, SKIP_SINGLE=skip_single,
            DOT_PRECISION=precision, FMA_SCALE=variant["FMA_SCALE"], DOT_ACC=variant["DOT_ACC"],
            LAZY_RESCALE=variant["LAZY_RESCALE"],
            num_warps=tiles.num_warps if block_m >= 128 else min(tiles.num_warps, 4), num_stages=num_stages,
        )

    def _paging(self):
        from rlt.attention.backends.triton_kernels import paging

        return paging

    def _decode(self, kernels, q, k, v, out, common, rows, nh, nkv, group, d, block_d, block_size,
                precision, max_seq_len, last_exited, pre):
        variant = self.decode_variant
        if variant == "auto":
            variant = "grouped"
        head_programs = nkv if variant == "grouped" else nh
        splits = self.splits_for(rows, head_programs, max_seq_len, q.device)
        fold = splits > 1 and fold_enabled(q, "attention")
        if splits > 1:
            acc, ml, counters = self._split_scratch(rows, nh, splits, d, q.device)
        else:
            acc = ml = counters = out  # not written
        tiles = self.split_decode_tiles if splits > 1 else self.decode_tiles
        block_n = tiles.block_n if block_d <= 128 else max(16, tiles.block_n // 2)
        pdl = kernel_options(q)  # rlt.attention.pdl: the decode kernels follow its contract
        heads_fastest = tiles.heads_fastest and rows <= 65535  # grid y is 16-bit
        launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages, HEADS_FASTEST=heads_fastest, **pdl)

        def grid(heads: int) -> tuple[int, int, int]:
            return (heads, rows, splits) if heads_fastest else (rows, heads, splits)

        if variant == "grouped":
            kernels.decode_grouped_kernel[grid(nkv)](
                q, k, v, out, acc, ml, counters, *common, splits,
                NUM_HEADS=nh, GROUP=group, BLOCK_G=max(16, _next_pow2(group)), HEAD_DIM=d, BLOCK_D=block_d,
                BLOCK_SIZE=block_size, BLOCK_N=max(16, block_n), SPLIT=splits > 1, LAST_EXITED=last_exited,
                PRE_RESOLVED=pre, DOT_PRECISION=precision, FOLD=fold, BLOCK_S=MAX_SPLITS, **launch,
            )
        else:
            kernels.decode_kernel[grid(nh)](
                q, k, v, out, acc, ml, counters, *common, splits,
                NUM_HEADS=nh, GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=block_size,
                BLOCK_N=block_n, SPLIT=splits > 1, LAST_EXITED=last_exited, PRE_RESOLVED=pre, FOLD=fold,
                BLOCK_S=MAX_SPLITS, **launch,
            )
        if splits > 1 and not fold:
            kernels.merge_splits_kernel[(rows, nh)](
                out, acc, ml, common[5], out.stride(0), splits,
                NUM_HEADS=nh, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=MAX_SPLITS,
                num_warps=4, **pdl,
            )

    def _prefill(self, kernels, q, k, v, out, common, rows, nkv, group, d, block_d, block_size,
                 precision, max_query_len, skip_single, last_exited, pre, skip_fresh=False):
        elem = q.element_size()
        tiles = self.fp32_prefill_tiles if elem == 4 else self.prefill_tiles
        gpad = _next_pow2(group)
        block_m = min(tiles.block_m, max(16, _next_pow2(max_query_len * gpad)))
        block_m = max(block_m, gpad)
        block_n = tiles.block_n
        num_stages = tiles.num_stages
        if block_d > 128:  # keep Q + pipelined K/V tiles inside shared memory (and registers)
            block_m, block_n, num_stages = min(block_m, 64), min(block_n, 32), min(num_stages, 2)
            block_m = max(block_m, gpad)
        block_n, num_stages = _fit_shared(block_m, block_n, num_stages, block_d, elem)
        block_q = block_m // gpad
        num_warps = tiles.num_warps if block_m >= 128 else min(tiles.num_warps, 4)
        n = q.shape[0]
        blocks = n // block_q + rows
        variant = tiles.variant_flags(elem)
        variant["HEADS_FASTEST"] = tiles.heads_fastest and blocks <= 65535  # grid y is 16-bit
        grid = (nkv, blocks) if variant["HEADS_FASTEST"] else (blocks, nkv)
        kernels.prefill_kernel[grid](
            q, k, v, out, *common[:-1], rows, common[-1],
            GROUP=group, GROUP_PAD=gpad, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=block_size,
            BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, LAST_EXITED=last_exited,
            SKIP_SINGLE=skip_single, PRE_RESOLVED=pre, DOT_PRECISION=precision, SKIP_FRESH=skip_fresh,
            num_warps=num_warps, num_stages=num_stages, **variant,
        )
