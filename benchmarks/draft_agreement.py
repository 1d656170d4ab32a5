"""How often a trained draft's top choice is the target's, teacher-forced over one file: the draft's
training forward (block-stale, as decoding sees the target), no decoding. A quick read of a draft's
quality between checkpoints (a speculative bench at three lengths takes most of an hour on a 2-core CPU).

    python benchmarks/draft_agreement.py --target hf:DIR --draft RUN/checkpoints[/step-N] --file F.py [--tokens 1024]

Prints JSON: top-1 agreement over the first --tokens tokens of the file, and the share of the target's
choices inside the draft's vocabulary (draft.vocab; 1.0 for a full one).
"""

from __future__ import annotations

import argparse
import json

import torch

from longctx.checkpoint.glide import load_glide_draft
from longctx.config import load_config
from longctx.data.tokenizer import load_tokenizer
from longctx.generate.loading import load_model
from longctx.generate.local import prefill
from longctx.models.glide import GlideDraft, block_stale_visible
from longctx.models.kv_cache import KVCache


def target_model(source: str):
    """The target (hf:DIR or a checkpoint) in fp32 on the CPU, as decoding here reads it."""
    cfg = load_config(None, {"model": {"init_from": source}, "train": {"seq_len": 2, "eval_interval": 0}})
    return load_model(cfg, torch.device("cpu"), torch.float32).eval()


def teacher_forced_logits(target, draft, ids: torch.Tensor) -> torch.Tensor:
    """The draft's logits at every position of `ids` [1, n], reading the target as decoding does: a GliDe
    draft the target's cache (block-stale), a Clover draft the target's final hidden states."""
    n = ids.shape[1]
    pos = torch.arange(n)[None]
    with torch.inference_mode():
        if isinstance(draft, GlideDraft):
            cache = KVCache.for_model(target, 1, n)
            prefill(target, cache, ids, 4096)
            kv = [(cache.k[i], cache.v[i]) for i in draft.target_layers]
            return draft(target, ids, pos, kv, block_stale_visible(n, draft.block)[None])[0]
        return draft(target, ids, pos, target(ids, pos, None, hidden=True), draft.block)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--file", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--tokenizer", default="", help="default: the target's tokenizer.json (hf:DIR)")
    args = ap.parse_args()
    target = target_model(args.target)
    draft = load_glide_draft(args.draft, target, "cpu")
    tok = load_tokenizer(args.tokenizer or args.target.removeprefix("hf:") + "/tokenizer.json")
    ids = torch.tensor([list(tok.encode(open(args.file).read()))[:args.tokens]])
    n = ids.shape[1]
    drafted = teacher_forced_logits(target, draft, ids)
    with torch.inference_mode():
        wanted = target(ids)[0].argmax(-1)
    vocab = getattr(draft, "vocab", None)
    inside = 1.0 if vocab is None else torch.isin(wanted, vocab.ids).float().mean().item()
    print(json.dumps({"draft": args.draft, "file": args.file, "tokens": n, "block": draft.block,
                      "top1_agreement": round((drafted.argmax(-1) == wanted).float().mean().item(), 4),
                      "target_choices_in_draft_vocab": round(inside, 4)}))


if __name__ == "__main__":
    main()
