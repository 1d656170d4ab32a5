"""A training step's time with the LM head over the scored rows only (ops/loss.py scored_rows, the default)
against over every row, as the share of scored labels falls (SFT with masked prompts, answer-only synthetic
samples, padding): one forward + backward of a small-width, large-vocabulary model, the least of --repeat,
both settings in the same run (ratios: this machine's absolute speed says nothing of a GPU's).

    python benchmarks/head_scored_rows.py --lengths 8192,16384 --shares 0.02,0.25,0.5,0.9,0.97 > out.json

Shapes: dim 256, 2 layers, vocab 32,768 (--vocab), memory.loss_chunk 4,096 (the head in chunks, as long
runs use it). The scored labels are one span at the end of the row (an answer after its prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from longctx.config import load_config
from longctx.data.samples import Batch
from longctx.models.llama import build_model
from longctx.ops.loss import IGNORE
from longctx.step.loss import forward_loss_sum


def _batch(n: int, vocab: int, share: float) -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, n), generator=g)
    labels = torch.full((1, n), IGNORE)
    scored = max(1, round(share * n))
    labels[0, n - scored:] = torch.randint(0, vocab, (scored,), generator=g)
    return Batch(tokens, labels, torch.arange(n)[None], None)


def _step_s(model, batch: Batch, skip: bool, repeat: int) -> float:
    moved = batch.to("cpu")
    # the batch's own index, whatever the share (as Batch.to sets it at 80% scored and below), or none
    moved.scored = (moved.labels.reshape(-1) != IGNORE).nonzero().squeeze(1) if skip else None
    best = float("inf")
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        forward_loss_sum(model, moved, None).backward()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--shares", default="0.02,0.25,0.5,0.9,0.97")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = load_config(overrides=["--model.dim=256", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2",
                                 "--model.ffn_dim=768", f"--model.vocab_size={args.vocab}"]).model
    model = build_model(cfg, seed=0)
    model.loss_chunk = 4096
    rows = []
    for n in map(int, args.lengths.split(",")):
        for share in map(float, args.shares.split(",")):
            batch = _batch(n, args.vocab, share)
            every, skip = _step_s(model, batch, False, args.repeat), _step_s(model, batch, True, args.repeat)
            row = {"tokens": n, "scored_share": share, "every_row_s": round(every, 4),
                   "scored_rows_s": round(skip, 4), "ratio": round(skip / every, 3)}
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    print(json.dumps({"model": {"dim": 256, "layers": 2, "vocab": args.vocab, "loss_chunk": 4096},
                      "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
