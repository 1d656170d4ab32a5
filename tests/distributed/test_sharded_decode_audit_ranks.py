"""Decoding on a cache sharded over head x ctx ranks (generate/sharded.py) against the independent
reference, the model's plain forward over each row's whole sequence (no cache): every step's logits,
on every rank, for the corners the layout makes:
- ragged rows whose lengths the layout's 2 x head x ctx unit does not divide, one of 1 token (most
  ranks hold none of its prompt: their partial is out 0, lse -inf in the merge);
- a speculative chain's call of 3 tokens (slots dealt over the ctx ranks) rolled back to 1 kept, then
  decoding on: the rejected slots given back, the positions right;
- a tree's call (among) of which a path is kept: the kept nodes at the positions of the path."""

import pytest
import torch

from longctx.job.spawn import run_spawned_many

LENGTHS = [1, 6, 5]  # ragged; none a multiple of 2 x head x ctx = 8; 1 < the ranks
STEPS = 4


def _model():
    from longctx.config import load_config
    from longctx.models.llama import build_model

    return build_model(load_config(overrides=["--model.layers=2", "--model.kv_heads=1"]).model, seed=3).eval()


def _full(model, seq):
    """The reference: the last position's logits of the plain forward over the whole sequence."""
    return model.logits(model.hidden_states(torch.tensor([seq])))[0, -1].float()


def _worst(model, cache, seqs, tokens_per_row) -> float:
    """Feed each row its next tokens (one call), compare every row's last logits to the reference."""
    logits = model(torch.tensor(tokens_per_row), cache=cache)[:, -1].float()
    return max((logits[r] - _full(model, seqs[r])).abs().max().item() for r in range(len(seqs)))


def _rank(head: int, ctx: int) -> dict:
    from longctx.config import load_config
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime

    cfg = load_config(overrides=[f"--parallel.head={head}", f"--parallel.ctx={ctx}"])
    rt = Runtime.create(cfg, torch.distributed.get_rank(), head * ctx, "cpu")
    backend, model = ShardedGeneration(rt.mesh, rt.world_mesh), _model()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 320, (n,), generator=g).tolist() for n in LENGTHS]
    out = {}
    with torch.inference_mode():
        cache = backend.cache(model, len(seqs), max(LENGTHS) + 16)
        for r, seq in enumerate(seqs):  # each length its own prefill group (rows view), as generate does
            first = backend.prefill(model, cache.rows(r, r + 1), torch.tensor([seq]), 4096)[0]
            out.setdefault("prefill", 0.0)
            out["prefill"] = max(out["prefill"], (first - _full(model, seq)).abs().max().item())
        worst = 0.0
        for t in range(STEPS):  # ragged decode
            nxt = [[(7 * t + 3 * r) % 320] for r in range(len(seqs))]
            seqs = [s + n for s, n in zip(seqs, nxt)]
            worst = max(worst, _worst(model, cache, seqs, nxt))
        out["ragged"] = worst
        out["chain"], out["tree"] = _chain(backend, model), _tree(backend, model)
        out["refusals"] = _refusals(backend, model)
    return out


def _refusals(backend, model) -> list[str]:
    """A prompt longer than the cache (here 10 tokens for 8: its shares fit the slack of the per-rank
    slots, so nothing failed) and a decode step past a prompt that fills the cache: each refused with
    what to do."""
    said = []
    for prompt, step in ((list(range(3, 13)), False), (list(range(3, 11)), True)):
        cache = backend.cache(model, 1, 8)
        try:
            backend.prefill(model, cache, torch.tensor([prompt]), 4096)
            if step:
                model(torch.tensor([[1]]), cache=cache)
            said.append(f"accepted: {len(prompt)} tokens (+ {int(step)}) in a cache of 8, rows at "
                        f"{cache.lengths.tolist()}")
        except ValueError as e:
            said.append(str(e))
    return said


def _chain(backend, model) -> float:
    """A prompt of 1 token; a chain of 3 (a, b, c) verified in one call, only a kept (b, c rejected:
    truncate), then d: each call's logits against the reference."""
    cache = backend.cache(model, 1, 24)
    seq = [11]
    backend.prefill(model, cache, torch.tensor([seq]), 4096)
    logits = model(torch.tensor([[5, 6, 7]]), cache=cache)[0].float()
    worst = max((logits[j] - _full(model, seq + [5, 6, 7][:j + 1])).abs().max().item() for j in range(3))
    cache.truncate(len(seq) + 1)
    worst = max(worst, _worst(model, cache, [seq + [5, 9]], [[9]]))
    return max(worst, _worst(model, cache, [seq + [5, 9, 4]], [[4]]))


def _tree(backend, model) -> float:
    """A tree root a with children b and c (both at the next position), the path a, c kept, then d."""
    cache = backend.cache(model, 1, 24)
    seq = [3, 8, 2]
    backend.prefill(model, cache, torch.tensor([seq]), 4096)
    cache.among(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))
    positions = torch.tensor([[3, 4, 4]])
    logits = model(torch.tensor([[5, 6, 7]]), positions, cache=cache)[0].float()
    worst = max((logits[j] - _full(model, seq + p)).abs().max().item()
                for j, p in enumerate([[5], [5, 6], [5, 7]]))
    cache.keep([0, 2])
    return max(worst, _worst(model, cache, [seq + [5, 7, 1]], [[1]]))


LAYOUTS = {"head2xctx2": (2, 2), "ctx4": (1, 4)}  # (head, ctx): 4 ranks each


@pytest.fixture(scope="module")
def decoded():
    """{layout's name: each rank's _rank}: both layouts in one spawned job of 4 ranks (starting ranks costs
    seconds a job; _rank builds its own mesh, model and cache)."""
    return run_spawned_many(4, [(name, _rank, layout) for name, layout in LAYOUTS.items()])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_decode_matches_the_full_forward(layout, decoded):
    for found in decoded[layout]:
        refusals = found.pop("refusals")
        assert all(v < 1e-4 for v in found.values()), found  # (a NaN fails too)
        assert "a prompt of 10 tokens does not fit a cache of at most 8" in refusals[0], refusals
        assert "at most 8 tokens per row; 8 held + 1 new do not fit" in refusals[1], refusals
        assert all("larger max_len" in said for said in refusals), refusals
