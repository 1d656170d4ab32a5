"""InfLLM's context memory (models/context_memory.py) against an independent float64 brute force of its
module docstring's rule, per layer and per call (prefill chunks and decode steps) of a tiny GQA model:
every key of the row, an explicit boolean mask of the keys each query sees (the initial tokens, the
chosen units, the local span), the RoPE distances the rule names (the real one in the local span, `far`
for the rest), representatives built once by the call a unit forms in, units chosen once per call by
the mean query score; plain softmax attention. The reference turns keys and queries with its own RoPE
(complex numbers) from the unrotated ones it recovers."""

import math

import pytest
import torch
from test_infllm import CFG, _prompt

from longctx.config import ModelConfig
from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.engine import generate
from longctx.models.context_memory import InfLLMShape
from longctx.models.llama import build_model


@pytest.fixture(scope="module")
def model():  # (test_infllm.py's model and prompts, another seed; one thread, as there)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_model(CFG, seed=7).eval()
    torch.set_num_threads(threads)


def _turn(x, pos, inv_freq):
    """x [..., d] (rotate-half pairs (j, j + d/2)) turned by angle pos x inv_freq (pos broadcast to x's
    leading dims), in float64 complex numbers."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * torch.polar(torch.ones_like(inv_freq.double()), pos.double()[..., None] * inv_freq.double())
    return torch.cat([z.real, z.imag], dim=-1)


class Recording(InfLLMGeneration):
    """The one-process backend, recording every core call: (layer, row's start, q, k, v, out), and the units
    each call with memory chose: {layer: [per call, each row's chosen units]}."""

    def __init__(self, shape):
        super().__init__(shape)
        self.calls, self.chosen = [], {}

    def cache(self, model, batch, max_len, core=None):
        cache = super().cache(model, batch, max_len)
        inner, select = cache.core, self.memory._select

        def selecting(index, q_far, units):
            chosen = select(index, q_far, units)
            self.chosen.setdefault(index, []).append([set(row) for row in chosen.tolist()])
            return chosen
        self.memory._select = selecting

        def core(q, k, v, layer, step):
            out = inner(q, k, v, layer, step)
            self.calls.append((layer.index, int(step.start[0]), q.clone(), k.clone(), v.clone(), out.clone()))
            return out
        cache.core = core
        return cache


class Reference:
    """One layer's brute force: keys/values of every slot (unrotated, float64), the units' representatives,
    and per call the boolean mask and the distances of the module docstring."""

    def __init__(self, shape, inv_freq, given=()):
        self.shape, self.inv_freq = shape, inv_freq.double()
        self.k = self.v = None  # [b, L, kv, d]
        self.reps = {}  # unit -> [b, kv, d]
        self.chosen = []  # per call with units: [b] sets of chosen units
        # the code's choices, call by call: taken where they are a top-k by this reference's scores (units
        # of identical tokens tie exactly in the first layer, and either is right), else an error
        self.given = iter(given)

    def call(self, start, q, k, v):
        """q [b, n, h, d], k/v [b, n, kv, d] as the core gets them (rotated at their slots): out float64."""
        sh, f = self.shape, self.inv_freq
        b, n, h, d = q.shape
        kv, g = k.shape[2], h // k.shape[2]
        pos = torch.arange(start, start + n)
        raw_q = _turn(q, -pos[:, None].expand(n, h), f)  # back to position 0
        raw_k = _turn(k, -pos[:, None].expand(n, kv), f)
        self.k = raw_k if self.k is None else torch.cat([self.k, raw_k], 1)
        self.v = v.double() if self.v is None else torch.cat([self.v, v.double()], 1)
        e = start + n
        init = min(sh.init, e)
        units = max(0, (e - sh.window - init) // sh.block)
        lo = init + units * sh.block
        slots = torch.arange(e)
        real_q = _turn(raw_q, pos[:, None].expand(n, h), f)  # [b, n, h, d]
        real_k = _turn(self.k, slots[:, None].expand(e, kv), f)  # [b, e, kv, d]
        far_q = _turn(raw_q, torch.full((n, h), sh.init + sh.window + sh.block - 1), f)  # the one distance
        for u in range(units):  # built once, by the call the unit forms in
            if u not in self.reps:
                self.reps[u] = self._representative(u, real_q, real_k)
        chosen = [set()] * b
        if units:
            scores = torch.stack([torch.einsum("bnhd,bhd->b", far_q, self.reps[u].repeat_interleave(g, 1)) / n
                                  for u in range(units)], 1)  # [b, units]
            chosen = [set(scores[r].topk(min(sh.topk, units)).indices.tolist()) for r in range(b)]
            given = next(self.given, None)
            if given is not None:
                tol = 1e-5 * scores.abs().max().item()
                for r in range(b):
                    others = [u for u in range(units) if u not in given[r]]
                    assert len(given[r]) == len(chosen[r]), (given, chosen)
                    assert not others or min(scores[r, list(given[r])]) >= max(scores[r, others]) - tol, \
                        (start, r, given[r], chosen[r], scores[r])
                chosen = given
            self.chosen.append(chosen)
        out = torch.zeros(b, n, h, d, dtype=torch.float64)
        for r in range(b):
            for i in range(n):
                p = start + i
                near = (slots >= lo) & (slots <= p) if units else slots <= p
                far = torch.zeros(e, dtype=torch.bool)
                if units:
                    far[:init] = True
                    for u in chosen[r]:
                        far[init + u * sh.block: init + (u + 1) * sh.block] = True
                assert not (near & far).any()
                for head in range(h):
                    kk = head // g
                    logits = torch.full((e,), -math.inf, dtype=torch.float64)
                    logits[near] = real_k[r, near, kk] @ real_q[r, i, head]
                    logits[far] = self.k[r, far, kk] @ far_q[r, i, head]  # keys at 0, query at `far`
                    w = torch.softmax(logits / math.sqrt(d), 0)
                    out[r, i, head] = w @ self.v[r, :, kk]
        return out

    def _representative(self, u, real_q, real_k):
        """[b, kv, d]: the sum of the unit's `repr` unrotated keys that the call's queries score highest
        per kv head (logits at real distances summed over the queries and the kv head's query heads)."""
        sh = self.shape
        b, n, h, d = real_q.shape
        kv = real_k.shape[2]
        a = sh.init + u * sh.block
        keys = real_k[:, a:a + sh.block]  # [b, block, kv, d]
        received = torch.einsum("bjkd,bnkgd->bjk", keys, real_q.view(b, n, kv, h // kv, d))
        top = received.topk(sh.repr, dim=1).indices  # [b, repr, kv]
        raw = self.k[:, a:a + sh.block]
        return torch.stack([torch.stack([raw[r, top[r, :, kk], kk].sum(0) for kk in range(kv)])
                            for r in range(b)])


def _check(model, shape, length, new, chunk, num_samples=1, seed=2, atol=2e-5):
    """generate through the recording backend; every call of every layer against the reference."""
    backend = Recording(shape)
    generate(model, [_prompt(length, seed)], max_new_tokens=new, prefill_chunk=chunk, num_samples=num_samples,
             backend=backend, **({} if num_samples == 1 else {"sampling": _sampling()}))
    refs = [Reference(shape, model.inv_freq, backend.chosen.get(layer, [])) for layer in range(CFG.layers)]
    calls = 0
    for layer, start, q, k, v, out in backend.calls:
        ref = refs[layer]
        if ref.k is not None and ref.k.shape[0] != q.shape[0]:  # the prefill's row copied to the samples
            ref.k, ref.v = ref.k.repeat(q.shape[0], 1, 1, 1), ref.v.repeat(q.shape[0], 1, 1, 1)
            ref.reps = {u: r.repeat(q.shape[0], 1, 1) for u, r in ref.reps.items()}
        want = ref.call(start, q, k, v)
        err = (out.double() - want).abs().max().item()
        calls += 1
        assert err < atol, (layer, start, q.shape[1], err)
    for layer, ref in enumerate(refs):  # every call with units chose (and was checked)
        assert len(backend.chosen.get(layer, [])) == len(ref.chosen), layer
    return backend, refs, calls


def _sampling():
    from longctx.generate.sampling import Sampling

    return Sampling(temperature=1.0, seed=3)


def _reached(shape, backend):
    """The boundaries the recorded calls of layer 0 met (prefill: several new tokens; decode: one)."""
    out = set()
    for layer, start, q, *_ in backend.calls:
        n, e = q.shape[1], start + q.shape[1]
        units = max(0, (e - shape.window - shape.init) // shape.block)
        before = max(0, (start - shape.window - shape.init) // shape.block)
        kind = "prefill" if n > 1 else "decode"
        if layer or not units:
            continue
        if not before:
            out.add(f"first unit ({kind})")
        if (e - shape.window - shape.init) % shape.block == 0:
            out.add(f"a unit whole at the call's end ({kind})")
        if e - shape.init - units * shape.block == shape.window + shape.block - 1:
            out.add(f"window + block - 1 local ({kind})")
        out.add("topk >= units" if shape.topk >= units else "topk < units")
    return out


CASES = {  # id: (shape, prompt, new tokens, prefill chunk, samples)
    "init4": (InfLLMShape(block=4, repr=2, topk=2, window=8, init=4), 40, 10, 4, 1),
    "init0": (InfLLMShape(block=4, repr=2, topk=2, window=8, init=0), 38, 11, 4, 1),
    "chunk3": (InfLLMShape(block=4, repr=3, topk=1, window=8, init=2), 37, 12, 3, 1),
    "all units": (InfLLMShape(block=4, repr=1, topk=50, window=8, init=4), 30, 8, 4, 1),
    "block1": (InfLLMShape(block=1, repr=1, topk=3, window=4, init=1), 15, 6, 2, 1),
    "samples": (InfLLMShape(block=2, repr=2, topk=3, window=8, init=1), 33, 9, 4, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_every_call_of_every_layer_follows_the_rule(model, case):
    shape, length, new, chunk, samples = CASES[case]
    backend, refs, calls = _check(model, shape, length, new, chunk, samples)
    assert calls == len(backend.calls) > 0 and all(ref.chosen for ref in refs)
    for layer, ref in enumerate(refs):  # the representatives themselves: the unrotated keys the rule picks
        got = backend.memory.reps[layer, :, :len(ref.reps)].double().transpose(0, 1)
        torch.testing.assert_close(got, torch.stack([ref.reps[u] for u in sorted(ref.reps)]), atol=1e-5, rtol=1e-5)
    reached = _reached(shape, backend)
    for kind in ("prefill", "decode"):
        assert {f"first unit ({kind})", f"a unit whole at the call's end ({kind})",
                f"window + block - 1 local ({kind})"} & reached, (kind, reached)
    if case == "all units":
        assert reached >= {"topk >= units"}
    assert any(r.startswith("a unit whole") for r in reached) and any("window + block - 1" in r for r in reached)


def test_plain_cached_attention_bit_for_bit_until_the_first_unit(model):
    # the last call holds init + window + block - 1 = 46 tokens: no unit yet, so the very numbers of the
    # plain cache (prefill chunks and decode steps)
    shape = InfLLMShape(block=8, repr=2, topk=2, window=32, init=7)
    prompt = _prompt(34, seed=4)
    plain = generate(model, [prompt], max_new_tokens=13, prefill_chunk=16, logprobs=0)[0]
    backend = Recording(shape)
    ours = generate(model, [prompt], max_new_tokens=13, prefill_chunk=16, logprobs=0, backend=backend)[0]
    assert max(start + q.shape[1] for _, start, q, *_ in backend.calls) == shape.init + shape.window + shape.block - 1
    assert ours.tokens == plain.tokens and ours.logprobs == plain.logprobs
    assert backend.memory.built.max() == 0


def test_a_call_with_queries_before_the_units_is_an_error(model):
    # 40 tokens in one call with a window of 8: its first queries would precede 7 units (and see them at
    # distance `far`) with no local span
    shape = InfLLMShape(block=4, repr=2, topk=2, window=8, init=4)
    backend = InfLLMGeneration(shape)
    cache = backend.cache(model, 1, 64)
    with torch.inference_mode(), pytest.raises(ValueError, match="feed at most --infllm-window 8 tokens per call"):
        model.hidden_states(torch.tensor([_prompt(40)]), cache=cache)


def test_prompts_of_different_lengths_are_an_error(model):
    # the second prompt's prefill (rows after the first's) would be scored against the first's units:
    # with one new token (no decode step to refuse the rows' lengths) its token came out silently wrong
    shape = InfLLMShape(block=4, repr=2, topk=2, window=8, init=4)
    with pytest.raises(ValueError, match="one prompt length at a time"):
        generate(model, [_prompt(40, 1), _prompt(44, 2)], max_new_tokens=1, backend=InfLLMGeneration(shape))
    same = generate(model, [_prompt(40, 1), _prompt(40, 2)], max_new_tokens=3, backend=InfLLMGeneration(shape))
    alone = [generate(model, [_prompt(40, s)], max_new_tokens=3, backend=InfLLMGeneration(shape))[0] for s in (1, 2)]
    assert [r.tokens for r in same] == [r.tokens for r in alone]  # one length: rows of their own


def test_speculation_on_the_memory_is_an_error(model):
    # a chain verified against one selection, then truncated: units built by (and chosen for) proposals the
    # cache no longer holds. Before: no error, and greedy speculation's tokens were not greedy decoding's
    # (the 2nd of 30 already differed); the sharded cache refused it, the one-process cache did not
    from longctx.generate.drafters import drafter_for
    from longctx.generate.speculative import speculative_generate

    shape = InfLLMShape(block=4, repr=2, topk=2, window=8, init=4)
    draft = build_model(ModelConfig(**{**CFG.__dict__, "layers": 1}), seed=9).eval()
    prompt = _prompt(40, 3)
    with pytest.raises(ValueError, match="does not verify speculative proposals"):
        speculative_generate(model, drafter_for(model, draft, 80), prompt, max_new_tokens=30, k=3,
                             backend=InfLLMGeneration(shape))


def test_a_reset_cache_builds_the_next_prompts_units_afresh(model):
    # reset() emptied the rows but not the memory: the next prompt's units were scored with the last one's
    # representatives (its prefill's last logits up to 4.7 off a fresh memory's, another argmax)
    shape = InfLLMShape(block=4, repr=2, topk=2, window=8, init=4)
    b = torch.tensor([_prompt(40, 5)])
    with torch.inference_mode():
        backend = InfLLMGeneration(shape)
        cache = backend.cache(model, 1, 48)
        backend.prefill(model, cache, torch.tensor([_prompt(40, 4)]), 4)
        cache.reset()
        again = backend.prefill(model, cache, b, 4)
        fresh_backend = InfLLMGeneration(shape)
        fresh = fresh_backend.prefill(model, fresh_backend.cache(model, 1, 48), b, 4)
    assert torch.equal(again, fresh)


# ------------------------------------------------------------------------------------------------
# the memory sharded over 2 ctx ranks (generate/sharded_infllm.py): every call of every layer against the
# same reference, and the same outputs as one process

SHARDED = [  # (shape, prompt, new tokens, prefill chunk, samples)
    (InfLLMShape(block=4, repr=2, topk=2, window=8, init=4), 41, 10, 4, 1),
    (InfLLMShape(block=4, repr=3, topk=1, window=8, init=0), 38, 9, 3, 2),
    (InfLLMShape(block=2, repr=1, topk=100, window=4, init=3), 27, 6, 2, 1),  # every unit chosen
]


def _sharded_calls(case: int):
    """On each of 2 ctx ranks: every _Layer.attend call (layer, start, q, k, v, out) of SHARDED[case], and how
    many parts (span or far) held no key here."""
    from longctx.config import load_config
    from longctx.generate import sharded_infllm
    from longctx.generate.sharded_infllm import ShardedInfLLMGeneration
    from longctx.job.runtime import Runtime

    torch.set_num_threads(1)
    shape, length, new, chunk, samples = SHARDED[case]
    model = build_model(CFG, seed=7).eval()
    rt = Runtime.create(load_config(overrides=["--parallel.ctx=2"]), torch.distributed.get_rank(), 2, "cpu")
    calls, attend, empty, empties = [], sharded_infllm._Layer.attend, sharded_infllm._empty, [0]

    def recording(self, q, k, v):
        out = attend(self, q, k, v)
        # (numpy: tensors would travel back as shared memory that dies with the rank)
        calls.append((self.index, int(self.cache.step.start[0]), *(t.numpy().copy() for t in (q, k, v, out))))
        return out
    def counting(q):  # a part with no key on this rank (merged by its lse -inf)
        empties[0] += 1
        return empty(q)
    sharded_infllm._Layer.attend, sharded_infllm._empty = recording, counting
    try:
        generate(model, [_prompt(length, case)], max_new_tokens=new, prefill_chunk=chunk, num_samples=samples,
                 backend=ShardedInfLLMGeneration(shape, rt.mesh),
                 **({} if samples == 1 else {"sampling": _sampling()}))
    finally:
        sharded_infllm._Layer.attend, sharded_infllm._empty = attend, empty
    return calls, empties[0]


def _sharded_one_call():
    """On each of 2 ctx ranks: a 40-token prompt in ONE call with a window of 8; (the error said, or how far
    the first 8 positions' hidden states are from plain causal attention, which they must equal)."""
    from longctx.config import load_config
    from longctx.generate.sharded_infllm import ShardedInfLLMGeneration
    from longctx.job.runtime import Runtime

    torch.set_num_threads(1)
    model = build_model(CFG, seed=7).eval()
    rt = Runtime.create(load_config(overrides=["--parallel.ctx=2"]), torch.distributed.get_rank(), 2, "cpu")
    backend = ShardedInfLLMGeneration(InfLLMShape(block=4, repr=2, topk=2, window=8, init=4), rt.mesh)
    tokens = torch.tensor([_prompt(40)])
    with torch.inference_mode():
        try:
            ours = model.hidden_states(tokens, cache=backend.cache(model, 1, 64))
        except ValueError as e:
            return "error", str(e)
        return "ran", (ours[0, :8] - model.hidden_states(tokens)[0, :8]).abs().max().item()


@pytest.fixture(scope="module")
def sharded_calls():
    from longctx.job.spawn import run_spawned_many

    return run_spawned_many(2, [*((case, _sharded_calls, (case,)) for case in range(len(SHARDED))),
                                ("one call", _sharded_one_call, ())], timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(SHARDED)))
def test_two_ctx_ranks_follow_the_rule_and_answer_as_one_process(model, sharded_calls, case):
    shape, length, new, chunk, samples = SHARDED[case]
    one = Recording(shape)
    generate(model, [_prompt(length, case)], max_new_tokens=new, prefill_chunk=chunk, num_samples=samples,
             backend=one, **({} if samples == 1 else {"sampling": _sampling()}))
    ranks = [calls for calls, _ in sharded_calls[case]]
    assert sum(empties for _, empties in sharded_calls[case]) > 0  # a rank held no key of a part
    assert all(len(calls) == len(one.calls) for calls in ranks)
    for rank, calls in enumerate(ranks):
        # (the one process's choices, checked to be a top-k by the reference's scores: an exact tie may go
        # either way, with the same keys)
        refs = [Reference(shape, model.inv_freq, one.chosen.get(layer, [])) for layer in range(CFG.layers)]
        for (layer, start, *arrays), (l1, s1, q1, _, _, out1) in zip(calls, one.calls):
            q, k, v, out = map(torch.from_numpy, arrays)
            assert (layer, start) == (l1, s1)
            torch.testing.assert_close(q, q1, atol=1e-5, rtol=1e-5)  # the same inputs (the model's run alike)
            ref = refs[layer]
            if ref.k is not None and ref.k.shape[0] != q.shape[0]:
                ref.k, ref.v = ref.k.repeat(q.shape[0], 1, 1, 1), ref.v.repeat(q.shape[0], 1, 1, 1)
                ref.reps = {u: r.repeat(q.shape[0], 1, 1) for u, r in ref.reps.items()}
            want = ref.call(start, q, k, v)
            assert (out.double() - want).abs().max() < 2e-5, (rank, layer, start)
            torch.testing.assert_close(out, out1, atol=2e-5, rtol=1e-5)
        assert any(ref.chosen for ref in refs)  # units formed and were chosen


@pytest.mark.slow
def test_two_ctx_ranks_refuse_a_call_with_queries_before_the_units(sharded_calls):
    # (before: no error, and the first positions attended the units after them: hidden states off by 4.06)
    for said in sharded_calls["one call"]:
        assert said[0] == "error" and "feed at most --infllm-window 8 tokens per call" in said[1], said


def test_a_window_past_a_prompt_names_a_fix_that_fits():
    from longctx.errors import ConfigError
    from longctx.generate.context_memory import check_prompts

    shape = InfLLMShape(block=8, repr=2, topk=2, window=32, init=4)
    check_prompts(shape, [{"ids": [1] * 32}])  # a window as long as the prompt: fine
    # the fix named fits the shortest prompt (before: the first short one's, 24, past a 13-token prompt)
    with pytest.raises(ConfigError, match=r"prompt 2 \(13 tokens; 2 prompts are\).*Use --infllm-window 8 or"):
        check_prompts(shape, [{"ids": [1] * 24}, {"ids": [1] * 13}])
    # a prompt shorter than a unit: no window of whole units fits it (before: "--infllm-window <= 8", past 5)
    with pytest.raises(ConfigError, match="an --infllm-block and --infllm-window of at most 5 or"):
        check_prompts(shape, [{"ids": [1] * 5}])
