"""Does InfLLM's memory retrieve the pass key's unit? Per layer, where the needle's memory unit ranks
among all units for the prompt's last query, under each unit score (issue 51's InfLLM item).

    python benchmarks/infllm_retrieval.py --checkpoint /tmp/smollm2_hf --length 8192 --depth 0.5 [--out F.json]

A passkey prompt (data/synthetic.py, filler: the standard library's email and json sources) is
prefilled through InfLLM's memory with its defaults (generate/context_memory.py). Then, per layer,
for the prompt's last query (turned to distance `far`, as the memory's keys are seen) against every
unit's keys (turned back to position 0):
- `chosen_by_call`: whether the call that produced the first answer token (the last prefill chunk,
  its units chosen by the mean of its queries) chose the needle's unit;
- `repr`: the rank of the needle's unit by the memory's own score (q . the summed representatives);
- `oracle`: its rank by the largest true logit over the unit's keys and the query heads (what a
  perfect unit score would rank by);
- `bound`: its rank by a Quest-style upper bound (per channel min / max of the unit's keys).
Rank 0 is the top; the memory attends the top --infllm-topk (8). JSON on stdout (and --out).
"""

from __future__ import annotations

import argparse
import email
import glob
import json
import os

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="an HF directory (SmolLM2: benchmarks/fetch_smollm2.py)")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from longctx.config import load_config
    from longctx.data.synthetic import retrieval_prompt
    from longctx.data.tokenizer import load_tokenizer
    from longctx.generate.context_memory import DEFAULTS, InfLLMGeneration
    from longctx.generate.loading import load_model
    from longctx.models.context_memory import InfLLMMemory, InfLLMShape, rotate, unit_scores

    torch.set_num_threads(1)
    cfg = load_config(None, {"model": {"init_from": f"hf:{args.checkpoint}"}, "train": {"seq_len": 2,
                                                                                     "eval_interval": 0}})
    model = load_model(cfg, torch.device("cpu"), torch.float32).eval()
    tokenizer = load_tokenizer(os.path.join(args.checkpoint, "tokenizer.json"))
    here = os.path.dirname(email.__file__)
    files = sorted(glob.glob(os.path.join(here, "*.py"))) + sorted(glob.glob(os.path.join(here, "..", "json", "*.py")))
    filler = np.asarray(tokenizer.encode("".join(open(f).read() for f in files)), dtype=np.int64)
    prompt = retrieval_prompt("passkey", filler, args.length, args.depth, np.random.default_rng(args.seed), tokenizer)
    ids = torch.tensor(prompt.tokens[:prompt.answer_start])[None]
    key = [int(t) for t in tokenizer.encode(" " + prompt.answer)]
    tokens = prompt.tokens.tolist()
    needle = next(i for i in range(len(tokens)) if tokens[i:i + len(key)] == key)
    shape = InfLLMShape(**DEFAULTS)
    unit = (needle - shape.init) // shape.block

    last_q, chosen = {}, {}
    core, select = InfLLMMemory.core, InfLLMMemory._select

    def recording_core(self, q, k, v, layer, step):
        last_q[layer.index] = q[:, -1:].clone()
        return core(self, q, k, v, layer, step)

    def recording_select(self, index, q_far, units):
        out = select(self, index, q_far, units)
        chosen[index] = out[0].tolist()
        return out

    InfLLMMemory.core, InfLLMMemory._select = recording_core, recording_select
    backend = InfLLMGeneration(shape)
    with torch.inference_mode():
        cache = backend.cache(model, 1, ids.shape[1] + 1)
        logits = backend.prefill(model, cache, ids, 4096)
        end = ids.shape[1]
        units = (end - shape.window - shape.init) // shape.block
        slots = torch.arange(shape.init, shape.init + units * shape.block)
        rows = []
        for layer in range(model.cfg.layers):
            q = rotate(last_q[layer], torch.tensor([[shape.far - (end - 1)]]), model.inv_freq).float()
            keys = cache.k[layer][0, :, shape.init:shape.init + units * shape.block].float()  # [kv, L, d]
            kv, _, d = keys.shape
            back = rotate(keys.transpose(0, 1)[None], -slots[None], model.inv_freq)[0].transpose(0, 1)
            per_unit = back.view(kv, units, shape.block, d)
            per_head = q[0, 0].view(kv, -1, d)  # [kv, group, d]
            oracle = torch.einsum("kgd,kubd->kgub", per_head, per_unit).amax(-1).amax(1).amax(0)
            low, high = per_unit.amin(2), per_unit.amax(2)
            bound = torch.maximum(per_head[:, :, None] * low[:, None],
                                  per_head[:, :, None] * high[:, None]).sum((0, 1, 3))
            own = unit_scores(q, backend.memory.reps[layer, :1, :units])[0]
            rows.append({"layer": layer, "chosen_by_call": unit in chosen.get(layer, []),
                         **{name: int((s > s[unit]).sum()) for name, s in (("repr", own), ("oracle", oracle),
                                                                           ("bound", bound))}})
    top = shape.topk
    result = {"benchmark": "infllm_retrieval", "checkpoint": args.checkpoint, "length": args.length,
              "depth": args.depth, "answer": prompt.answer, "needle_token": needle, "needle_unit": unit,
              "units": units, "topk": top, "first_token": tokenizer.decode([int(logits.argmax())]),
              "layers_chosen_by_call": sum(r["chosen_by_call"] for r in rows),
              **{f"layers_top{top}_{name}": sum(r[name] < top for r in rows) for name in ("repr", "oracle", "bound")},
              "per_layer": rows}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
