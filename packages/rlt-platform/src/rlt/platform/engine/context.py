"""Building the :class:`EngineContext`: load the checkpoint, choose attention, size the KV pool.

Everything here happens once, before any component is built; the context is frozen afterwards.
"""

from __future__ import annotations

from typing import Any, Mapping

from rlt.attention import KVCache, KVLayout
from rlt.platform.attention_select import build_attention, select_attention
from rlt.platform.checkpoint.demo import resolve_model
from rlt.platform.checkpoint.loader import load_checkpoint as _load_checkpoint
from rlt.platform.checkpoint.loader import read_config, resolve_dtype
from rlt.platform.checkpoint.tokenizer import RltTokenizer
from rlt.platform.config import EngineConfig
from rlt.platform.engine.interfaces import EngineContext, KVSpec
from rlt.platform.errors import ConfigError
from rlt.platform.platforms import Platform
from rlt.platform.uva import decide_uva


def _kv_blocks(config: EngineConfig, platform: Platform, bytes_per_block: int, full_need: int,
               reserved: int = 0) -> int:
    """The pool's size in blocks: an explicit count (requests' blocks) plus what features reserve, else
    what every slot can need plus the reserve, within the memory budget."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks + reserved
    if platform.device_module is not None and hasattr(platform.device_module, "mem_get_info"):
        free, _total = platform.device_module.mem_get_info()
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = int((config.kv_cache_memory_gib or 1.0) * 2**30)
    return max(1, min(full_need + reserved, budget // bytes_per_block))


def reserved_kv_blocks(feature_options: Mapping[str, Any], num_loops: int, max_num_seqs: int) -> int:
    """Blocks enabled features take out of the KV pool for good (``KVManager.reserve``), which the
    pool's size adds to what every slot can need: each feature's options may say how many
    (``reserved_kv_blocks(num_loops=, max_num_seqs=, features=)``; rlt-spec's wide chains)."""
    total = 0
    for opts in feature_options.values():
        fn = getattr(opts, "reserved_kv_blocks", None)
        if callable(fn):
            total += int(fn(num_loops=num_loops, max_num_seqs=max_num_seqs, features=frozenset(feature_options)))
    return total


def attention_constraints(config: EngineConfig) -> dict[str, Any]:
    """What the engine declares to the attention selector about its KV semantics."""
    return {"block_size": config.block_size, "kv_layout": config.kv_layout, "adaptive_exit": not config.fixed_depth}


def build_context(config: EngineConfig, platform: Platform, feature_options: Mapping[str, Any] | None = None,
                  *, load_checkpoint=None) -> EngineContext:
    device = platform.device()
    if platform.name == "npu":
        platform.select_device(device.index or 0)
    model_dir = resolve_model(config.model)
    _root, _raw, family, model_cfg = read_config(model_dir)
    if family.engine_unsupported:
        raise ConfigError(f"{model_dir}: {family.engine_unsupported}")
    dtype = resolve_dtype(config.dtype, getattr(model_cfg, "torch_dtype", None))
    ckpt = (load_checkpoint or _load_checkpoint)(model_dir, dtype=dtype, device=device)
    tokenizer = RltTokenizer.from_dir(model_dir)
    model = ckpt.family.build_runtime(ckpt.config, ckpt.weights)
    shape = model.shape
    if tokenizer.vocab_size > shape.vocab_size:
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {shape.vocab_size}")
    max_model_len = config.max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's "
                          f"max_position_embeddings {shape.max_position_embeddings}")
    num_loops = config.num_loops or shape.num_loops
    if model.boundary_attention and config.kv_layout is not KVLayout.LAST_EXITED:
        raise ConfigError(f"{model_dir}: {family.model_type} is served with the last_exited KV layout only (its "
                          "eager reference defines per-recurrence KV); drop --kv-layout or set it to last_exited")
    selection = select_attention(platform, config.attention_backend, dtype=dtype, head_dim=shape.head_dim,
                                 **attention_constraints(config))
    attention = build_attention(platform, selection)
    planes = 1 if config.kv_layout is KVLayout.SHARED else num_loops
    # Boundary layers (prelude + coda attention, one plane) ride on the core pool's blocks: block b of
    # the boundary cache belongs to whoever owns block b of the core cache, addressed through the
    # plane-0 page tables, so one allocator serves both (every core block carries boundary storage).
    layers = shape.num_layers + shape.num_boundary_layers
    bpb = KVCache.bytes_per_block(num_layers=layers, block_size=config.block_size,
                                  num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=dtype)
    pages = -(-max_model_len // config.block_size)
    num_blocks = _kv_blocks(config, platform, bpb, config.max_num_seqs * pages * planes,
                            reserved_kv_blocks(feature_options or {}, num_loops, config.max_num_seqs))
    kv_kw = dict(num_blocks=num_blocks, block_size=config.block_size, num_kv_heads=shape.num_kv_heads,
                 head_dim=shape.head_dim, dtype=dtype, device=device)
    cache = KVCache.allocate(num_layers=shape.num_layers, num_planes=planes, layout=config.kv_layout, **kv_kw)
    boundary = (KVCache.allocate(num_layers=shape.num_boundary_layers, num_planes=1, layout=KVLayout.SHARED, **kv_kw)
                if shape.num_boundary_layers else None)
    return EngineContext(
        config=config, platform=platform, device=device, dtype=dtype, model_dir=model_dir, model_type=family.model_type,
        model=model, tokenizer=tokenizer, cache=cache,
        kv=KVSpec(layout=config.kv_layout, block_size=config.block_size, num_blocks=num_blocks, num_planes=planes,
                  max_pages=pages),
        attention=attention, selection=selection, uva=decide_uva(platform),
        max_model_len=max_model_len, num_loops=num_loops, max_num_seqs=config.max_num_seqs,
        default_loops=min(shape.num_loops, num_loops) if model.per_request_depth else num_loops,
        boundary_cache=boundary,
        max_num_batched_tokens=config.max_num_batched_tokens or default_step_budget(max_model_len),
        # Fixed full depth unless asked otherwise (the checkpoint's early_exit_threshold is not a
        # serving default: HF computes every loop regardless, so adopting it would change semantics).
        default_threshold=config.exit_threshold if config.exit_threshold is not None else 1.0,
        eos_token_ids=(frozenset(ckpt.family.stop_token_ids(ckpt.config, tokenizer, ckpt.generation_config))
                       & set(range(shape.vocab_size))),
        feature_options=dict(feature_options or {}),
    )


#: The step token budget when none is given: vLLM's serving default (8,192 tokens) or the context
#: length when that is larger, so a whole prompt always fits one step without chunked prefill.
#: A budget of only ``max_model_len`` (2,048 for a 2K server) admits two 1K prompts per step, and a
#: burst of 64 then waits through 32 prefill waves (measured on the H200: TTFT p50 6.6 s).
DEFAULT_STEP_BUDGET = 8192


def default_step_budget(max_model_len: int) -> int:
    return max(max_model_len, DEFAULT_STEP_BUDGET)
