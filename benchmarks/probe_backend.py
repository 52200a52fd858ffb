"""Pre-flight check of an attention backend on this device, run as its own process.

``python -m benchmarks.probe_backend --backend triton`` builds a small random Ouro model with the
real head size (2 heads x 128, 2 layers) and runs the engine with the torch backend and with the
probed one: in float32 the greedy tokens must be identical (the numerics contract), in bfloat16
the run must finish. Exit status 0 means the backend can be used for a benchmark. It runs in its
own process so that a kernel fault (a sticky device error) cannot take the benchmark down with
it; ``scripts/bench_h200.sh`` falls back to the torch backend when it fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback

import torch

from benchmarks.bench_model import write_random_checkpoint
from rlt.platform.config import EngineConfig
from rlt.platform.engine.llm import LLM
from rlt.platform.sampling_params import SamplingParams

PROBE_SHAPES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=128, vocab_size=512, max_position_embeddings=512)


def _generate(model_dir: str, backend: str, dtype: str, device: str) -> list[list[int]]:
    llm = LLM.from_config(EngineConfig(model=model_dir, device=device, dtype=dtype, attention_backend=backend,
                                       max_num_seqs=4, max_model_len=160, num_kv_blocks=4 * 10 * 4))
    prompts = [[3 + (7 * i + j) % 500 for j in range(n)] for i, n in enumerate((5, 17, 33, 70))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    bad = [o for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"{backend}/{dtype}: request {bad[0].request_id} ended {bad[0].finish_reason}: {bad[0].error}")
    return [list(o.token_ids) for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = str(write_random_checkpoint(tmp, "ouro-tiny", seed=7, torch_dtype="float32", **PROBE_SHAPES))
            ref = _generate(model, "torch", "float32", args.device)
            got = _generate(model, args.backend, "float32", args.device)
            if got != ref:
                same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
                print(f"probe: {args.backend} float32 greedy tokens differ from torch ({same}/{sum(map(len, ref))} same)")
                return 1
            ref16 = _generate(model, "torch", "bfloat16", args.device)
            got16 = _generate(model, args.backend, "bfloat16", args.device)
            same16 = sum(a == b for r, g in zip(ref16, got16) for a, b in zip(r, g))
            print(f"probe: {args.backend} ok on {args.device}: float32 tokens identical to torch; "
                  f"bfloat16 {same16}/{sum(map(len, ref16))} tokens equal")
            return 0
    except Exception as exc:  # noqa: BLE001 - any failure means "do not use this backend"
        traceback.print_exc()
        print(f"probe: {args.backend} unusable: {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
