"""Generation under head x ctx layouts (generate/sharded.py) against one process (generate/engine.py
with its local cache), on random tiny models in fp32:
- greedy 32 new tokens (NEW) from prompts of 4K and 16K tokens are token-identical under head 2 x ctx 2,
  ctx 4 and head 2, and the first step's logits agree to 1e-4;
- several prompts of different lengths decoded together (ragged rows, one of 3 tokens: fewer than
  the ranks, so some rank holds none of its slots) equal one process;
- seeded sampling gives the same tokens under every layout; per request (issue 47), under head 2 x ctx 2
  with every logits processor on, a prompt's tokens are one process's and the same alone, in a batch of
  three and as sample 0 of two (the sharded cache's rows copied for the samples); greedy speculation
  with the penalties on the sharded cache is one process's plain greedy decoding with them;
- GQA with kv heads replicated over the head group (1 kv head, head 2), and an MoE model;
- each rank's cache is 1/(head x ctx) of one process's (plus the decode slack), and the shares
  of a row stay within one slot of each other as tokens are dealt.
The layouts' cases run in two spawned jobs (4 ranks, 2 ranks), each case its own model."""

import functools

import pytest
import torch

from longctx.job.spawn import run_spawned_many

NEW = 32  # decode steps per case: a wrong merge or a misplaced slot shows within a few


def _model(kind: str):
    from longctx.config import load_config
    from longctx.models.llama import build_model
    from longctx.models.moe import moe_layers

    overrides = {"dense": ["--model.layers=2"], "mqa": ["--model.layers=2", "--model.kv_heads=1"],
                 "moe": ["--model.preset=debug-moe"]}[kind]
    model = build_model(load_config(overrides=overrides).model, seed=3).eval()
    if kind == "moe":
        with torch.no_grad():  # routers of some conviction, as a trained model has
            for i, layer in enumerate(moe_layers(model)):
                layer.router.gate.weight.copy_(torch.randn(layer.router.gate.weight.shape,
                                                           generator=torch.Generator().manual_seed(i)) * 0.3)
    return model


def _prompt(length, seed):
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = {
    "4K": ("dense", [4096], {}),
    "16K": ("dense", [16384], {}),
    "ragged": ("dense", [1000, 37, 3, 1000], {}),
    "sampled": ("dense", [700, 301], {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 5}),
    "mqa": ("mqa", [2048], {}),
    "moe": ("moe", [1024], {}),
}


def _generate(case: str, head: int, ctx: int):
    """(tokens per prompt, first logits, cache bytes of this rank, slots per rank after decode)."""
    from longctx.generate.engine import generate
    from longctx.generate.local import LOCAL
    from longctx.generate.sampling import Sampling
    from longctx.models.kv_cache import KVCache

    kind, lengths, sampling = CASES[case]
    model = _model(kind)
    prompts = [_prompt(n, seed=i + 1) for i, n in enumerate(lengths)]
    if head * ctx == 1:
        backend, cache = LOCAL, KVCache.for_model(model, 1, lengths[0] + NEW)
    else:
        from longctx.config import load_config
        from longctx.generate.sharded import ShardedGeneration
        from longctx.job.runtime import Runtime

        cfg = load_config(overrides=[f"--parallel.head={head}", f"--parallel.ctx={ctx}"])
        rt = Runtime.create(cfg, torch.distributed.get_rank(), head * ctx, "cpu")
        backend = ShardedGeneration(rt.mesh, rt.world_mesh)
        cache = backend.cache(model, 1, lengths[0] + NEW)
    with torch.inference_mode():  # the first prompt alone, by hand: its logits, and its cache's slots
        logits = first = backend.prefill(model, cache, torch.tensor([prompts[0]]), 4096)[0]
        for _ in range(NEW - 1):
            logits = model(logits.argmax()[None, None], cache=cache)[0, -1]
    results = generate(model, prompts, max_new_tokens=NEW, sampling=Sampling(**sampling), backend=backend)
    return [r.tokens for r in results], first, cache.nbytes, getattr(cache, "local", None)


@functools.cache
def _reference(case):
    return _generate(case, 1, 1)


def _speculate(head: int, ctx: int, cape: bool = False, glide: bool = False):
    """Greedy speculative decoding (a draft with its own cache, K = 3; with `cape`, CaPE's tree; with
    `glide`, a GliDe draft reading the target's cache) on the target's cache sharded over head x ctx
    (one process with 1 x 1): (tokens, proposals kept per pass)."""
    from longctx.generate.cape import DEFAULT_TABLE, CapeTable
    from longctx.generate.drafters import GlideDrafter, ModelDrafter
    from longctx.generate.speculative import speculative_generate
    from longctx.models.glide import GlideDraft

    backend, _ = _backend_and_cache(head, ctx, _model("dense"), 8)
    draft = _model("dense")  # the target with a noisy LM head: it agrees often, not always
    with torch.no_grad():
        w = draft.lm_head_weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * 0.6)
    prompt, target = _prompt(1000, seed=4), _model("dense")
    drafter = ModelDrafter(draft, 1200)
    if glide:  # random GliDe weights, large enough that its cross-attention matters; the target's head
        glide_draft = GlideDraft(target.cfg, 1).init_weights(seed=5, std=0.2).eval()
        drafter = GlideDrafter(glide_draft, target, 1200, block=3)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=NEW, k=3,
                               backend=backend, cape=CapeTable.parse(DEFAULT_TABLE) if cape else None)
    return out.tokens, out.accepted


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 2), (1, 2)], ids=["head2xctx2", "ctx2"])
def test_speculative_verification_on_a_sharded_cache_is_plain_greedy(layout, layouts):
    """The target verifies K + 1 tokens per pass on its sharded cache (new slots dealt over the ctx
    ranks, causal among themselves by position) and rolls back the rejected ones: the output is one
    process's plain greedy decoding, on every rank."""
    from longctx.generate.engine import generate

    plain = generate(_model("dense"), [_prompt(1000, seed=4)], max_new_tokens=NEW)[0].tokens
    per_rank = layouts[("speculate", layout)]
    for tokens, accepted in per_rank:
        assert tokens == plain
        assert accepted == per_rank[0][1]
    accepted = per_rank[0][1]
    assert 0 < sum(accepted) and min(accepted) < 3  # proposals kept, and some rejected (rolled back)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 2), (1, 2)], ids=["head2xctx2", "ctx2"])
def test_cape_tree_on_a_sharded_cache_is_plain_greedy_and_keeps_what_one_process_keeps(layout, layouts):
    """CaPE's tree (alternatives where the draft hesitates) verified in one call on the sharded cache
    (tree mask among the new slots, wherever they were dealt), then only the accepted path kept, each
    rank keeping the nodes it holds: one process's greedy output, and the same path lengths per round
    as CaPE on one process's cache."""
    from longctx.generate.engine import generate

    plain = generate(_model("dense"), [_prompt(1000, seed=4)], max_new_tokens=NEW)[0].tokens
    one_tokens, one_accepted = _speculate(1, 1, cape=True)
    assert one_tokens == plain
    for tokens, accepted in layouts[("cape", layout)]:
        assert tokens == plain
        assert accepted == one_accepted
    chain = layouts[("speculate", layout)][0][1]
    assert sum(one_accepted) / len(one_accepted) > sum(chain) / len(chain)  # the tree keeps more per pass


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 2), (1, 2)], ids=["head2xctx2", "ctx2"])
def test_a_glide_draft_reads_the_sharded_cache_as_it_reads_one_process_cache(layout, layouts):
    """A GliDe draft's cross-attention reads the target's cache where it lies (each rank its share,
    merged): the proposals, and so the kept counts per pass, are one process's, and the output is
    plain greedy decoding."""
    from longctx.generate.engine import generate

    plain = generate(_model("dense"), [_prompt(1000, seed=4)], max_new_tokens=NEW)[0].tokens
    one_tokens, one_accepted = _speculate(1, 1, glide=True)
    assert one_tokens == plain
    for tokens, accepted in layouts[("glide", layout)]:
        assert tokens == plain
        assert accepted == one_accepted
    # the draft's distributions themselves (random weights rarely agree with the target, so the kept
    # counts alone would not show a wrong read): those of one process
    want = _glide_proposals(1, 1)
    for got in layouts[("glide proposals", layout)]:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _glide_proposals(head: int, ctx: int):
    """A random GliDe draft's log-probabilities [3, vocab] over 3 proposals after a 301-token prompt (its
    prompt pass block-stale over the target's cache, then the cache as prefilled), read from the
    target's cache on one device or sharded."""
    from longctx.generate.drafters import GlideDrafter
    from longctx.generate.sampling import Sampling
    from longctx.models.glide import GlideDraft

    target = _model("dense")
    backend, cache = _backend_and_cache(head, ctx, target, 400)
    prompt = _prompt(301, seed=6)
    drafter = GlideDrafter(GlideDraft(target.cfg, 1).init_weights(seed=5, std=0.2).eval(), target, 400, block=3)
    with torch.inference_mode():
        backend.prefill(target, cache, torch.tensor([prompt]), 4096)
        drafter.start(prompt, cache)
        _, q = drafter.propose(7, 3, Sampling(temperature=1.0), None)
    return q.log()  # (log: the draft is unsure, its probabilities all near 1 / vocab)


def _backend_and_cache(head: int, ctx: int, model, max_len: int):
    """The generation backend of a head x ctx layout (one process: the local one) and a 1-row cache."""
    from longctx.generate.local import LOCAL
    from longctx.models.kv_cache import KVCache

    if head * ctx == 1:
        return LOCAL, KVCache.for_model(model, 1, max_len)
    from longctx.config import load_config
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime

    rt = Runtime.create(load_config(overrides=[f"--parallel.head={head}", f"--parallel.ctx={ctx}"]),
                        torch.distributed.get_rank(), head * ctx, "cpu")
    backend = ShardedGeneration(rt.mesh, rt.world_mesh)
    return backend, backend.cache(model, 1, max_len)


def _read(head: int, ctx: int, kind: str):
    """Another model's read of the cache (a GliDe draft's cross-attention): after a prefill of 301
    tokens and a 4-token chain call of which 2 are kept, queries with per-query position limits.
    One process (1 x 1): the same masked attention over the one-device cache."""
    from longctx.models.cached_attention import masked_attention

    model = _model(kind)
    cfg = model.cfg
    q = torch.randn(1, 5, cfg.heads, cfg.resolved_head_dim, generator=torch.Generator().manual_seed(0))
    limit = torch.tensor([[0, 1, 150, 302, 303]])
    backend, cache = _backend_and_cache(head, ctx, model, 400)
    with torch.inference_mode():
        backend.prefill(model, cache, torch.tensor([_prompt(301, seed=2)]), 4096)
        model(torch.tensor([[5, 6, 7, 8]]), cache=cache)
        cache.truncate(303)
        if head * ctx > 1:
            return cache.read_attention(cfg.layers - 1, q, limit)
        slots = torch.arange(cache.k.shape[3])
        visible = (slots[None, None] < limit[..., None]) & (slots < 303)
        return masked_attention(q, cache.k[cfg.layers - 1], cache.v[cfg.layers - 1], visible)[0]


READS = {(2, 2): "dense", (1, 2): "dense", (2, 1): "mqa"}  # head 2 with 1 kv head: replicated over heads


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(READS), ids=["head2xctx2", "ctx2", "head2-mqa"])
def test_a_sharded_cache_read_with_position_limits_is_the_one_process_read(layout, layouts):
    """read_attention: each rank its heads over its slots (prefilled, decoded, truncated), masked by
    the slots' positions, merged over ctx and gathered over heads, equals one process's masked
    attention over the whole cache (a query that sees nothing: 0)."""
    want = _read(1, 1, READS[layout])
    for got in layouts[("read", layout)]:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got[0, 0].abs().max() == 0  # limit 0: nothing visible


# per-request seeds (issue 47): T = 1 with every processor, 32 new tokens; prompt A (seed 77) alone, in a
# batch of three of other lengths, and with two samples per prompt (the sharded cache's rows copied)
SEEDED = {"temperature": 1.0, "top_k": 60, "top_p": 0.95, "min_p": 0.01, "repetition_penalty": 1.2,
          "presence_penalty": 0.3, "frequency_penalty": 0.2}


def _seeded(head: int, ctx: int):
    """(A alone, A in a batch of 3, the batch's 3 x 2 samples) on one process (1 x 1) or head x ctx ranks."""
    from longctx.generate.engine import generate
    from longctx.generate.sampling import Sampling

    model = _model("dense")
    backend, _ = _backend_and_cache(head, ctx, model, 8)
    a, others = _prompt(301, seed=7), [_prompt(45, seed=8), _prompt(700, seed=9)]
    s = Sampling(**SEEDED)
    alone = generate(model, [a], max_new_tokens=NEW, sampling=s, seeds=[77], backend=backend)[0].tokens
    batch = [others[0], a, others[1]]
    together = generate(model, batch, max_new_tokens=NEW, sampling=s, seeds=[1, 77, 2], backend=backend)[1].tokens
    samples = generate(model, batch, max_new_tokens=NEW, sampling=s, seeds=[1, 77, 2], backend=backend,
                       num_samples=2)
    return alone, together, [r.tokens for r in samples]


def _speculate_penalised(head: int, ctx: int):
    """Greedy speculative decoding (K = 3, a noisy draft) with the repetition and frequency penalties on
    the target's cache sharded over head x ctx: (tokens, proposals kept per pass)."""
    from longctx.generate.drafters import ModelDrafter
    from longctx.generate.sampling import Sampling
    from longctx.generate.speculative import speculative_generate

    backend, _ = _backend_and_cache(head, ctx, _model("dense"), 8)
    draft = _model("dense")
    with torch.no_grad():
        w = draft.lm_head_weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * 0.6)
    out = speculative_generate(_model("dense"), ModelDrafter(draft, 1200), _prompt(1000, seed=4), max_new_tokens=NEW,
                               k=3, backend=backend, sampling=Sampling(repetition_penalty=1.3, frequency_penalty=0.5))
    return out.tokens, out.accepted


@pytest.mark.slow
def test_a_request_draws_its_own_tokens_under_head2_ctx2(layouts):
    """Every rank of head 2 x ctx 2 draws one process's tokens for each request, and A's are the same
    alone, in a batch of three, and as sample 0 of two (sample 1 differs). Greedy speculation with the
    penalties on the sharded cache is one process's plain greedy decoding with them. (Both run in the
    module's 4-rank job: their own job started 4 more ranks for two functions.)"""
    from longctx.generate.engine import generate
    from longctx.generate.sampling import Sampling

    want_alone, want_together, want_samples = _seeded(1, 1)
    assert want_alone == want_together == want_samples[2] and len(want_alone) == NEW
    assert want_samples[3] != want_samples[2]
    got = {"seeded": layouts[("seeded", (2, 2))], "speculate": layouts[("speculate penalised", (2, 2))]}
    for alone, together, samples in got["seeded"]:
        assert alone == want_alone and together == want_together and samples == want_samples
    plain = generate(_model("dense"), [_prompt(1000, seed=4)], max_new_tokens=NEW,
                     sampling=Sampling(repetition_penalty=1.3, frequency_penalty=0.5))[0].tokens
    assert plain != generate(_model("dense"), [_prompt(1000, seed=4)], max_new_tokens=NEW)[0].tokens
    for tokens, accepted in got["speculate"]:
        assert tokens == plain and accepted == got["speculate"][0][1]
    assert 0 < sum(got["speculate"][0][1]) and min(got["speculate"][0][1]) < 3  # kept and rejected proposals


FOUR = {(case, layout): (_generate, (case, *layout)) for case in CASES for layout in ((2, 2), (1, 4))}
FOUR[("speculate", (2, 2))] = (_speculate, (2, 2))
FOUR[("cape", (2, 2))] = (_speculate, (2, 2, True))
FOUR[("glide", (2, 2))] = (_speculate, (2, 2, False, True))
FOUR[("glide proposals", (2, 2))] = (_glide_proposals, (2, 2))
FOUR[("read", (2, 2))] = (_read, (2, 2, READS[(2, 2)]))
FOUR[("seeded", (2, 2))] = (_seeded, (2, 2))
FOUR[("speculate penalised", (2, 2))] = (_speculate_penalised, (2, 2))
TWO = {(case, (2, 1)): (_generate, (case, 2, 1)) for case in CASES}
TWO[("speculate", (1, 2))] = (_speculate, (1, 2))
TWO[("cape", (1, 2))] = (_speculate, (1, 2, True))
TWO[("glide", (1, 2))] = (_speculate, (1, 2, False, True))
TWO[("glide proposals", (1, 2))] = (_glide_proposals, (1, 2))
TWO.update({("read", layout): (_read, (*layout, READS[layout])) for layout in ((1, 2), (2, 1))})


@pytest.fixture(scope="module")
def layouts():
    four = run_spawned_many(4, [(key, fn, args) for key, (fn, args) in FOUR.items()])
    two = run_spawned_many(2, [(key, fn, args) for key, (fn, args) in TWO.items()])
    return {**four, **two}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 2), (1, 4), (2, 1)], ids=["head2xctx2", "ctx4", "head2"])
@pytest.mark.parametrize("case", list(CASES))
def test_layouts_generate_what_one_process_does(case, layout, layouts):
    want_tokens, want_first, one_bytes, _ = _reference(case)
    per_rank = layouts[(case, layout)]
    for tokens, first, _, _ in per_rank:
        assert tokens == want_tokens  # every rank returns the same, one process's tokens
        assert torch.allclose(first, want_first, atol=1e-4, rtol=0)
    assert all(len(t) == NEW for t in want_tokens)
    head, ctx = layout
    if case == "16K":
        ratio = max(b for _, _, b, _ in per_rank) / one_bytes
        # the kv heads split over head (2 of them here), the slots over ctx, plus the decode slack
        assert ratio <= 1 / (head * ctx) + 0.02, ratio
        held = [local[0] for _, _, _, local in per_rank]
        assert max(held) - min(held) <= 1 and sum(held) == (16384 + NEW - 1) * head  # each slot on one ctx rank
