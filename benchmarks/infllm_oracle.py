"""Is InfLLM's unit selection or the model the limit? `longctx eval --task passkey --mode generate
--context-memory infllm ...` run in this process with the memory's unit selection replaced (--select):

- rule: the memory's own (unchanged; each call's choice is still logged);
- needle: the pass key's units forced into every call's top-k once they are in memory (an oracle: what
  any selection rule could at best retrieve), the other slots by the memory's scores;
- needle_recent: the pass key's units and the most recent units (the text just before the local span),
  so the retrieved text has one gap.

    python benchmarks/infllm_oracle.py --select needle -- --checkpoint hf:DIR --task passkey --lengths 32768 \\
        --depths 0.5 --samples 5 --data grass.txt --context-memory infllm --infllm-positions shared --threads 1

Everything after `--` is eval's command line (its JSON goes to stdout as eval writes it). One line per
sequence goes to stderr: the key, the generated text, and per call after the needle entered memory how many
layers chose one of its units (the prefill's last 4 calls, the first 6 decode steps).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--select", choices=("rule", "needle", "needle_recent"), default="rule")
    ap.add_argument("eval_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    import longctx.eval.generate_mode as generate_mode
    from longctx.cli import main as longctx_main
    from longctx.models import context_memory as cm

    state = {"needle": (0, 0), "calls": []}
    answers = generate_mode._generate_answers

    def logged_answers(model, tokenizer, group, sampling, seed, prefix=(), **engine):
        seq = group[0]
        tokens = list(prefix) + seq.tokens[:generate_mode.answer_start(seq)].tolist()
        mark = [int(t) for t in tokenizer.encode(" The pass key is")]
        start = next(i for i in range(len(tokens)) if tokens[i:i + len(mark)] == mark)
        state["needle"], state["calls"] = (start, start + 30), []  # (the needle sentence: ~27 tokens)
        out = answers(model, tokenizer, group, sampling, seed, prefix, **engine)
        prefill = [sum(c) for n, c in state["calls"] if n > 1]
        decode = [sum(c) for n, c in state["calls"] if n == 1]
        print(json.dumps({"sample": seq.sample, "depth": seq.depth, "answer": seq.answer, "text": out[0],
                          "needle_chosen_layers": {"prefill_last": prefill[-4:], "decode_first": decode[:6]}}),
              file=sys.stderr, flush=True)
        return out

    def select(self, index, q_far, units):
        scores = cm.unit_scores(q_far, self.reps[index, :q_far.shape[0], :units])
        lo, hi = state["needle"]
        needle = sorted({(s - self.shape.init) // self.shape.block for s in range(lo, hi)
                         if s >= self.shape.init and (s - self.shape.init) // self.shape.block < units})
        if args.select == "needle_recent":
            scores = torch.arange(units, dtype=scores.dtype).expand_as(scores).clone()
        if args.select != "rule":
            scores[:, needle] = float("inf")
        chosen = cm.top_units(scores, self.shape.topk)
        if needle:
            if index == 0:
                state["calls"].append((q_far.shape[1], []))
            state["calls"][-1][1].append(int(any(u in chosen[0].tolist() for u in needle)))
        return chosen

    generate_mode._generate_answers = logged_answers
    cm.InfLLMMemory._select = select
    rest = args.eval_args[1:] if args.eval_args[:1] == ["--"] else args.eval_args
    return longctx_main(["eval", *rest])


if __name__ == "__main__":
    sys.exit(main())
