"""The family registry and each family's weight spec against the released configurations.

Parameter totals are models.md's (§1.2, §2.2, §3.1), computed there from the architecture, so a
wrong shape or a missing / extra tensor in a family's weight spec shows up here without weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlt.platform.models import MODEL_FAMILIES

OURO_14B = dict(model_type="ouro", vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                num_attention_heads=16, num_key_value_heads=16, head_dim=128, max_position_embeddings=65536,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, total_ut_steps=4,
                early_exit_threshold=1.0, torch_dtype="bfloat16")
HUGINN = dict(model_type="huginn_raven", n_embd=5280, n_heads=55, num_key_value_heads=55, head_dim=96, n_layers=8,
              n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2, intermediate_size=17920,
              vocab_size=65536, padded_vocab_size=65536, block_size=4096, rope_base=50000, norm_eps=1e-6,
              qk_bias=True, bias=False, tie_embeddings=True, injection_type="linear", state_init="like-init",
              mean_recurrence=32, init_values={"embed_scale": 72.6636084983398, "std": 0.008703882797784892},
              torch_dtype="float32", bos_token_id=65504, eos_token_id=65505, pad_token_id=65509)
NANBEIGE = dict(model_type="nanbeige", vocab_size=166144, hidden_size=3072, intermediate_size=10752,
                num_hidden_layers=22, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=262144, rope_theta=70000000, rms_norm_eps=1e-5, attention_bias=False,
                num_loops=2, loop_loss_weights=[], skip_loop_final_norm=False, pretraining_tp=1,
                tie_word_embeddings=False, pad_token_id=0, bos_token_id=166100, eos_token_id=166101,
                torch_dtype="bfloat16")


def _params(raw):
    fam = MODEL_FAMILIES[raw["model_type"]]
    cfg = fam.parse_config(raw)
    return fam, cfg, sum(math.prod(s) for s in fam.expected_weights(cfg).values())


@pytest.mark.parametrize("raw,total", [
    (OURO_14B, 1_434_652_673), ({**OURO_14B, "num_hidden_layers": 48}, 2_667_974_657),
    (HUGINN, 3_564_976_800), (NANBEIGE, 4_169_800_704),
])
def test_weight_specs_match_released_parameter_counts(raw, total):
    assert _params(raw)[2] == total


def test_huginn_optional_tensors_are_the_released_duplicates():
    fam, cfg, _ = _params(HUGINN)
    optional = fam.optional_weights(cfg)
    # lm_head (tied duplicate) and freqs_cis: the released shards hold exactly these on top (models.md §2.2)
    assert optional == {"lm_head.weight": (65536, 5280), "freqs_cis": (1, 4096, 1, 48, 2)}
    assert sum(math.prod(s) for s in optional.values()) == 346_030_080 + 393_216


@pytest.mark.parametrize("raw,shape", [
    (OURO_14B, dict(num_layers=24, num_kv_heads=16, head_dim=128, num_loops=4, num_boundary_layers=0)),
    (HUGINN, dict(num_layers=4, num_kv_heads=55, head_dim=96, num_loops=32, num_boundary_layers=4)),
    (NANBEIGE, dict(num_layers=22, num_kv_heads=8, head_dim=128, num_loops=2, num_boundary_layers=0)),
])
def test_release_configs_parse_to_the_documented_shapes(raw, shape):
    """The runtime's shape (what the KV pools are sized by), built on meta tensors: no memory."""
    fam, cfg, _ = _params(raw)
    weights = {k: torch.empty(s, device="meta") for k, s in fam.expected_weights(cfg).items()}
    model = fam.build_runtime(cfg, weights)
    assert {k: getattr(model.shape, k) for k in shape} == shape


def test_release_stop_ids_and_engine_support():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def token_to_id(self, t):
            return self.vocab.get(t)

    ouro, huginn, nanbeige = (MODEL_FAMILIES[t] for t in ("ouro", "huginn_raven", "nanbeige"))
    ouro_cfg = ouro.parse_config(OURO_14B)
    assert ouro.stop_token_ids(ouro_cfg, Tok({"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2})) == (2, 0)
    assert huginn.stop_token_ids(huginn.parse_config(HUGINN), Tok({"<|end_text|>": 65505, "<|end_turn|>": 65508})) \
        == (65505, 65508)
    assert nanbeige.stop_token_ids(nanbeige.parse_config(NANBEIGE), Tok({})) == (166101,)
    assert ouro.engine_unsupported is None and nanbeige.engine_unsupported is None
    assert huginn.engine_unsupported is None  # the engine serves all three (BoundaryExecutor for Huginn)


def _without(raw, *keys):
    return {k: v for k, v in raw.items() if k not in keys}


@pytest.mark.parametrize("raw,want", [
    # OuroConfig (configuration_ouro.py): Qwen2 defaults, num_key_value_heads 32 when the key is absent
    (_without({**OURO_14B, "num_attention_heads": 32}, "rope_theta", "max_position_embeddings", "rms_norm_eps",
              "num_key_value_heads", "head_dim", "total_ut_steps", "early_exit_threshold", "tie_word_embeddings"),
     dict(rope_theta=10000.0, max_position_embeddings=32768, rms_norm_eps=1e-6, num_key_value_heads=32, head_dim=64,
          total_ut_steps=4, early_exit_threshold=1.0, tie_word_embeddings=False)),
    ({**OURO_14B, "num_key_value_heads": None}, dict(num_key_value_heads=16)),  # explicit null: the query heads
    # NanbeigeConfig (configuration_nanbeige.py of the release): Llama-style defaults, one loop
    (_without(NANBEIGE, "rms_norm_eps", "rope_theta", "num_loops", "max_position_embeddings", "num_key_value_heads",
              "eos_token_id", "tie_word_embeddings"),
     dict(rms_norm_eps=1e-6, rope_theta=10000.0, num_loops=1, max_position_embeddings=2048, num_key_value_heads=48,
          eos_token_id=2, tie_word_embeddings=False)),
    # RavenConfig (raven_config_minimal.py)
    (_without(HUGINN, "norm_eps", "rope_base", "qk_bias", "tie_embeddings", "block_size", "mean_recurrence",
              "init_values"),
     dict(norm_eps=1e-6, rope_base=50000.0, qk_bias=True, tie_embeddings=True, block_size=4096, mean_recurrence=32,
          init_std=math.sqrt(2 / (5 * 5280)), embed_scale=math.sqrt(5280))),
])
def test_omitted_fields_take_the_public_config_class_defaults(raw, want):
    """A config.json that leaves a field out runs with what the public config class puts there (the
    release configs give every field, so only hand-written or trimmed configs see these)."""
    cfg = MODEL_FAMILIES[raw["model_type"]].parse_config(raw)
    assert {k: getattr(cfg, k) for k in want} == want


def test_more_refusals_of_what_the_public_code_would_compute_differently():
    from rlt.platform import CheckpointError

    nanbeige, ouro = MODEL_FAMILIES["nanbeige"], MODEL_FAMILIES["ouro"]
    for change, message in (({"pretraining_tp": 2}, "pretraining_tp 2"),
                            ({"emb_neighbor_num": 3, "emb_split_num": 2, "ngram_vocab_size_ratio": 0.5},
                             "emb_neighbor_num, emb_split_num, ngram_vocab_size_ratio are set"),
                            ({"enable_h_res_identity": True}, "enable_h_res_identity is set")):
        with pytest.raises(CheckpointError, match=message):
            nanbeige.parse_config({**NANBEIGE, **change})
    with pytest.raises(CheckpointError, match="hidden_act 'gelu' is not supported for Ouro"):
        ouro.parse_config({**OURO_14B, "hidden_act": "gelu"})
    # use_sliding_window without a layer past max_window_layers is full attention in OuroConfig
    assert ouro.parse_config({**OURO_14B, "use_sliding_window": True, "max_window_layers": 24})
    with pytest.raises(CheckpointError, match="sliding-window attention"):
        ouro.parse_config({**OURO_14B, "use_sliding_window": True, "max_window_layers": 23})


def test_attend_hands_the_stored_kv_to_a_backend_that_takes_it(tiny_checkpoint):
    """StackModel.attend passes ``new_kv`` (the step's post-RoPE K/V) only to a backend whose
    ``takes_new_kv`` is set, and they are exactly the values just stored at the step's slots (what the
    Triton backend's dense prefill reads instead of the pages)."""
    import torch

    from rlt.attention.backends.torch_ref import TorchReferenceBackend
    from rlt.attention.synthetic import random_problem
    from rlt.platform.checkpoint import load_checkpoint

    class Spy(TorchReferenceBackend):
        takes_new_kv = True
        seen = []

        def forward(self, query, kv, layer, meta, scale, new_kv=None):
            self.seen.append(new_kv)
            return super().forward(query, kv, layer, meta, scale)

    ck = load_checkpoint(tiny_checkpoint(seed=5), dtype=torch.float32)
    model = ck.family.build_runtime(ck.config, ck.weights)
    cfg = ck.config
    pb = random_problem([(9, 9, 1), (12, 5, 2)], num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, block_size=4, num_planes=4, num_layers=cfg.num_hidden_layers, layer=1)
    a = torch.randn(pb.query.shape[0], cfg.hidden_size)
    rope = model.rotary(pb.meta.positions)
    model.attend(1, model.layers[1], a, rope, pb.kv, Spy(), pb.meta)
    (k, v), = Spy.seen
    flat = lambda t: t[1].reshape(-1, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
    assert torch.equal(k, flat(pb.kv.k)[pb.meta.slot_mapping]) and torch.equal(v, flat(pb.kv.v)[pb.meta.slot_mapping])
    Spy.takes_new_kv = False
    model.attend(1, model.layers[1], a, rope, pb.kv, Spy(), pb.meta)
    assert Spy.seen[-1] is None
