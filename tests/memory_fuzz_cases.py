"""The random cases of tests/unit/test_memory_fuzz116.py: a seeded training configuration the config rules accept
(`make_case`, `case_config`) and its step's packed micro-batches (`micro_batches`), built here from the rules the
loader documents (data/loader.py), not by the loader.

A case draws a tiny Llama (dense, or MoE with every `moe_every`-th seed), a value of every [memory] key that
decides what a step keeps, recomputes or where it keeps it (recompute none / full / selective; offload_fraction 0,
a number or 'auto'; offload_skip_last 0 to past the depth; block_chunk, attention_chunk, loss_chunk and
expert_chunk 0 or a few tokens, 1 included; attention_offload; grad_sync; model_states device or host_optimizer,
ZeRO-Offload's AdamW on host masters), the step's settings (grad_accum 1-3, grad_clip off or at a fraction of the
reference's norm, loss_weighting token / sequence, fp32 or bf16 autocast) and its data (rows, seq_len, document
masks on or off, documents of random lengths, padding, labels ignored at random).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from longctx.config import load_config

IGNORE = -100

# each family's attention switches as its rules want them (config/rules.py): biases, q/k norms and their span
FAMILIES = {
    "llama": lambda bias: {"family": "llama", "qkv_bias": bias, "out_bias": bias},
    "qwen2": lambda bias: {"family": "qwen2", "qkv_bias": True, "out_bias": False},
    "qwen3": lambda bias: {"family": "qwen3", "qk_norm": True, "qk_norm_span": "head"},
    "qwen3_moe": lambda bias: {"family": "qwen3_moe", "qk_norm": True, "qk_norm_span": "head"},
    "olmoe": lambda bias: {"family": "olmoe", "qk_norm": True, "qk_norm_span": "all"},
}


def make_case(seed: int, moe_every: int = 3) -> dict:
    """One random case (a dict of plain values, printed in a failure's message). An MoE case recomputes more
    often and in pieces more often, and has a capacity in two of three: the pieces of a call whose routing looks
    across its tokens (a capacity's drops) must route as the call (memory/apply_policy.py). Its router is the
    softmax top-k: the Sinkhorn router's balanced assignment leaves its marginal tokens nearly indifferent between
    experts, so a last-bit change of the logits (fp32 against float64, or a chunked kernel's order of additions)
    flips choices and moves the loss by ~1e-5 (seeds 11 and 74 of an earlier draw: with and without a policy
    alike); tests/unit/test_moe_fuzz116.py checks its routing in a policy's pieces at the layer."""
    rng = random.Random(seed)
    moe = seed % moe_every == moe_every - 1
    layers = rng.randint(2, 4)
    heads = rng.choice([2, 4])
    recompute = rng.choice(["none", "full", "selective", "selective"] + ["full", "selective"] * moe)
    seq = rng.randint(8, 40)
    offload = 0.0 if recompute == "none" else rng.choice([0.0, 0.0, 1.0, 0.5, round(rng.uniform(0.05, 0.95), 2)])
    if recompute == "selective" and rng.random() < 0.12:
        offload = "auto"
    attention_chunk = rng.choice([0, 0, 1, rng.randint(2, seq)])
    return dict(
        seed=seed, moe=moe, layers=layers, heads=heads, kv_heads=rng.choice([k for k in (1, 2, heads) if k <= heads]),
        head_dim=rng.choice([4, 8]), dim=rng.choice([16, 24, 32]), ffn_dim=rng.choice([24, 40, 64]),
        vocab=rng.choice([37, 64, 101]), tie=rng.random() < 0.3,
        family=rng.choice(["llama", "llama", "qwen3_moe", "olmoe"] if moe else ["llama", "llama", "qwen2", "qwen3"]),
        bias=rng.random() < 0.4,
        experts=rng.randint(2, 6), top_k=1 + (rng.random() < 0.5),
        capacity=rng.choice([0.0, 0.75, 1.5]) if moe else 0.0,
        aux_loss=rng.choice([0.0, 0.05]), z_loss=rng.choice([0.0, 0.01]),
        recompute=recompute, offload_fraction=offload,
        # (past the depth only where nothing is offloaded: the rules refuse an offload that moves no block)
        offload_skip_last=rng.choice([0, 1, 1, layers - 1] + ([layers + 1] if not offload else [])),
        block_chunk=0 if recompute == "none" else rng.choice([0, 0, 1, rng.randint(2, 2 * seq)] + [5, 11] * moe),
        attention_chunk=attention_chunk,
        attention_offload=bool(attention_chunk) and rng.random() < 0.5,
        loss_chunk=rng.choice([0, 0, 1, rng.randint(2, 2 * seq)]),
        expert_chunk=rng.choice([0, 1, rng.randint(2, 16)]) if moe else 0,
        grad_sync=rng.choice(["step", "micro_batch"]),
        grad_accum=rng.randint(1, 3), clip_ratio=rng.choice([0.0, 0.0, 0.3, 0.8, 3.0]),
        weighting=rng.choice(["token", "sequence"]),
        bf16=rng.random() < 0.2,
        rows=rng.randint(1, 3), seq=seq, doc_mask=rng.random() < 0.7,
        pad=rng.random() < 0.5, ignore=rng.choice([0.0, 0.0, 0.3, 0.85]),
        lr=1e-2, weight_decay=rng.choice([0.0, 0.1]),
        # (last: the other keys' draws stay what they were)
        model_states=rng.choice(["device", "device", "device", "host_optimizer"]),
    )


def case_config(case: dict, memory: dict | None = None, grad_clip: float = 0.0):
    """The case's validated Config (load_config applies the rules a run's config meets); `memory`: [memory]
    keys in place of the case's (the policy-off run of a bf16 case)."""
    model = {"preset": "debug-moe" if case["moe"] else "debug", "dim": case["dim"], "layers": case["layers"],
             "heads": case["heads"], "kv_heads": case["kv_heads"], "head_dim": case["head_dim"],
             "ffn_dim": case["ffn_dim"], "vocab_size": case["vocab"], "tie_embeddings": case["tie"],
             "init_std": 0.2, **FAMILIES[case["family"]](case["bias"])}
    if case["moe"]:
        model.update({"moe.experts": case["experts"], "moe.top_k": min(case["top_k"], case["experts"]),
                      "moe.expert_dim": 12, "moe.dense_layers": "0", "moe.capacity_factor": case["capacity"],
                      "moe.aux_loss": case["aux_loss"], "moe.z_loss": case["z_loss"]})
    mem = memory if memory is not None else {
        key: case[key] for key in ("recompute", "offload_fraction", "offload_skip_last", "block_chunk",
                                   "attention_chunk", "attention_offload", "loss_chunk", "expert_chunk", "grad_sync",
                                   "model_states")}
    # lr constant from the first step (no warmup); eps 1e-3 keeps AdamW's first update, lr g / (|g| + eps),
    # a smooth function of the gradient (at 1e-8 it is lr sign(g) wherever |g| >> 1e-8, and a gradient of 1e-9
    # that rounding moves by 1e-9 moves its weight by up to lr)
    train = {"seed": case["seed"], "seq_len": case["seq"], "global_batch": case["rows"] * case["grad_accum"],
             "grad_accum": case["grad_accum"], "grad_clip": grad_clip, "loss_weighting": case["weighting"],
             "lr": case["lr"], "warmup_steps": 0, "lr_schedule": "constant", "weight_decay": case["weight_decay"],
             "eps": 1e-3, "steps": 1, "dtype": "bf16" if case["bf16"] else "fp32"}
    return load_config(overrides={"model": model, "memory": mem, "train": train})


@dataclass
class Micro:
    """One micro-batch as the loader would hand it over: tokens, labels, positions, doc_ids (None without
    document masks), real (False at padding)."""
    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor | None
    real: torch.Tensor


def _row(rng: random.Random, case: dict) -> tuple[list[int], int]:
    """A row's document lengths and its real tokens (the rest is padding)."""
    seq = case["seq"]
    real = rng.randint(max(1, seq // 3), seq) if case["pad"] else seq
    lengths, left = [], real
    while left:
        n = min(left, rng.choice([1, 2, rng.randint(1, seq)]))
        lengths.append(n)
        left -= n
    return lengths, real


def micro_batches(case: dict, draw: int = 0) -> list[Micro]:
    """The step's grad_accum micro-batches (`draw` 1: the next step's) of `rows` packed rows: with document masks
    each document its own positions from 0 and its own id (padding the next id), a label where the next token is
    in the same document; without, one causal row (labels across documents). Padding has no label; `ignore` of
    the labels are dropped at random (an answer-only sample's prompt)."""
    rng = random.Random(10_000 * (1 + draw) + case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 7919 * draw)
    rows, seq = case["rows"], case["seq"]
    out = []
    for _ in range(case["grad_accum"]):
        tokens = torch.randint(0, case["vocab"], (rows, seq), generator=gen)
        labels = torch.full((rows, seq), IGNORE, dtype=torch.long)
        positions = torch.arange(seq).repeat(rows, 1)
        doc_ids = torch.zeros(rows, seq, dtype=torch.long)
        real = torch.zeros(rows, seq, dtype=torch.bool)
        for r in range(rows):
            lengths, n_real = _row(rng, case)
            real[r, :n_real] = True
            start = 0
            for d, n in enumerate([*lengths, seq - n_real]):
                doc_ids[r, start:start + n] = d
                positions[r, start:start + n] = torch.arange(n)
                start += n
            for t in range(n_real - 1):
                same = doc_ids[r, t] == doc_ids[r, t + 1] or not case["doc_mask"]
                if same and rng.random() >= case["ignore"]:
                    labels[r, t] = tokens[r, t + 1]
        if not case["doc_mask"]:
            positions = torch.arange(seq).repeat(rows, 1)
        out.append(Micro(tokens, labels, positions, doc_ids if case["doc_mask"] else None, real))
    return out
