"""The fused greedy heads kernel's launch shapes (``rlt.spec.heads``: vocabulary entries per iteration x
warps), timed on a GPU: one program per row walks the row's logits in ``BLOCK``-wide pieces, so at the
chain steps' one or two head rows its time is the latency of ``vocab / BLOCK`` dependent iterations
(lease 14 on an H100: ~23 us a launch at 2048 x 4 over Ouro's 49,152 entries, on a step of ~1.5 ms).

    python -m benchmarks.spec_heads_sweep --out "$OUT/heads.json"

Rows: 1 (a plain row's sample), 2 (a chain's draft and check), 8 and 64 (batches); bf16 logits. Each
cell is the median of three ``triton.testing.do_bench_cudagraph`` medians after a discarded warm-up
(``benchmarks.attention_bench.med3``). Prints the table and the shape with the least summed time over
the 1- and 2-row cases (the chain steps' sizes), to set as ``RLT_SPEC_HEADS_TILES`` or
``rlt.spec.heads.DEFAULT_TILES``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.attention_bench import med3
from rlt.spec.heads import DEFAULT_TILES, launch
from rlt.spec.heads_kernel import CHECK, DRAFT, SAMPLE

SHAPES = [(b, w) for b in (1024, 2048, 4096, 8192, 16384) for w in (4, 8, 16)]


def descriptor(rows: int, device) -> torch.Tensor:
    """Every row a head: one sample row alone, else drafts and checks alternating (a chain's pair)."""
    desc = torch.zeros(5, rows, dtype=torch.int64)
    desc[0] = desc[4] = torch.arange(rows)
    desc[1] = SAMPLE if rows == 1 else torch.tensor([DRAFT, CHECK]).repeat((rows + 1) // 2)[:rows]
    desc[2] = rows + torch.arange(rows)  # token-table entries past the slots
    desc[3] = torch.arange(rows)
    return desc.to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152)  # Ouro's
    p.add_argument("--rows", default="1,2,8,64")
    p.add_argument("--out", default="")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    table: dict[str, dict[int, float]] = {}
    for block, warps in SHAPES:
        key = f"{block}x{warps}"
        table[key] = {}
        for n in rows:
            logits = torch.randn(n, a.vocab, device="cuda", dtype=torch.bfloat16)
            dev = descriptor(n, "cuda")
            token_table = torch.zeros(2 * n, dtype=torch.int64, device="cuda")
            dead = torch.zeros(n, dtype=torch.bool, device="cuda")
            ms = med3(lambda: launch(logits, dev, n, token_table, dead, (block, warps)), graph=True)
            table[key][n] = statistics.median(ms) * 1e3
    default = f"{DEFAULT_TILES[0]}x{DEFAULT_TILES[1]}"
    chain = {k: sum(v[n] for n in rows if n <= 2) for k, v in table.items()}
    best = min(chain, key=chain.get)
    print("| BLOCK x warps | " + " | ".join(f"{n} rows (us)" for n in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for k, v in table.items():
        mark = " (default)" if k == default else ""
        print(f"| {k}{mark} | " + " | ".join(f"{v[n]:.2f}" for n in rows) + " |")
    print(f"best for the chain steps' 1-2 rows: {best} ({chain[best]:.2f} us against {chain[default]:.2f} us)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"vocab": a.vocab, "rows": rows, "us": table, "best": best, "default": default,
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "method": "median of 3 triton.testing.do_bench_cudagraph medians after 1 discarded warm-up"}, f,
                      indent=1)


if __name__ == "__main__":
    main()
