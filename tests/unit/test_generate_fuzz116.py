"""A randomized audit of `longctx generate` against an independent reference (genfuzz, 116).

The reference (tests/generate_reference.py) knows nothing of the engine: the model's full forward over the
whole sequence every step (no cache), the step-1 processors written from their documentation, the argmax,
and the end rules as generate/engine.py and the CLI state them (EOS not kept; a stop string in the row's
text, the whole decoded less the prompt's decoding, or the limit; a stop's line cut where it begins).

Each of CASES random cases goes through what `longctx generate` runs (generate/cli.py _run): Output with
the stop strings (the byte tokenizer, its ids >= 256 silent, or a Llama-like one of pieces and byte
fallback with text prompts), and `generate` for a batch (random lengths and limits, flat and chunked
prefill, EOS ids, num_samples, penalties and min_new_tokens) or `speculate_one` for one prompt with a
draft (the target itself, a perturbed copy, a smaller model, GliDe or Clover with random weights and a
reduced vocabulary or not, a prompt window or not), a chain of K in 1..6 or CaPE's tree, fixed or
adaptive K, a confidence stop or not; on models of every attention and RoPE kind (ARCHES). Its JSON
lines (tokens, text, finish_reason) must be the reference's. A step whose two best logits lie within
TIE is a near-tie that rounding may flip: that row is compared up to it only.

Also: InfLLM's memory retrieving every unit is the full forward; at T > 0 with a seed, a prompt's tokens
do not depend on the prompts beside it in its batch or their order, and the same seed gives the same
tokens twice (plain and speculative); on 2 gloo ranks (slow), ctx- or head-sharded generation and
ctx-sharded InfLLM are one process's.
"""

from __future__ import annotations

import copy
import functools
import json
import random

import pytest
import torch

from generate_reference import BYTES, expected_line, reference, sentencepiece_like, text_after
from longctx.config import load_config
from longctx.generate.cape import DEFAULT_TABLE, CapeTable
from longctx.generate.engine import generate
from longctx.generate.output import Output
from longctx.generate.sampling import GREEDY, Sampling
from longctx.generate.speculative import speculate_one
from longctx.models.clover import CloverDraft
from longctx.models.glide import GlideDraft
from longctx.models.llama import build_model

CASES = 48
TEXT = "abcdefghij    th\u00e9\u00f1\u4e2d\U0001f600!\n"  # a text prompt's characters: pieces, and bytes
DRAFTS = ("self", "perturbed", "small", "glide", "glide-reduced", "clover", "clover-reduced")


# model variants the cached decode must follow as the full forward does (attention and RoPE kinds)
ARCHES = ((), (), ("--model.kv_heads=1",), ("--model.family=qwen2", "--model.kv_heads=4", "--model.qkv_bias=true"),
          ("--model.family=qwen3", "--model.qk_norm=true"),
          ("--model.family=olmoe", "--model.qk_norm=true", "--model.qk_norm_span=all", "--model.moe.experts=4"),
          ("--model.rope_scaling=linear", "--model.rope_factor=4"),
          ("--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=64"),
          ("--model.rope_scaling=llama3", "--model.rope_factor=4", "--model.rope_original_max_len=64"),
          ("--model.tie_embeddings=true",), ("--model.rope_ms_poe=true", "--model.rope_ms_poe_skip_layers=0"),
          ("--model.moe.experts=4", "--model.moe.top_k=2"))


@functools.cache
def _model(seed: int, layers: int, vocab: int, arch: tuple = ()):
    model = build_model(load_config(overrides=[f"--model.layers={layers}", f"--model.vocab_size={vocab}",
                                               *arch]).model, seed=seed).eval()
    with torch.no_grad():  # (a sharper head: fewer near-ties, and more repeats for the penalties to act on)
        model.lm_head_weight.mul_(4.0)
    return model


def _draft(kind: str, target, rng: random.Random):
    """A draft of `kind` for `target`, random (untrained) weights."""
    cfg, vocab = target.cfg, target.cfg.vocab_size
    if kind == "self":
        return target
    if kind == "perturbed":  # (mostly the target's choices: long accepted runs, ends inside a round)
        draft = copy.deepcopy(target)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02 * (p.std() if p.numel() > 1 else 1))
        return draft
    if kind == "small":
        return _model(rng.randrange(100, 104), 1, vocab)
    size = rng.randrange(vocab // 4, vocab // 2) if kind.endswith("reduced") else 0
    seed = rng.randrange(1000)
    if kind.startswith("glide"):
        draft = GlideDraft(cfg, layers=rng.randint(1, cfg.layers), vocab=size).init_weights(seed=seed, std=0.05)
    else:
        draft = CloverDraft(cfg, vocab=size).init_weights(seed=seed, std=0.1)
    draft.block = rng.choice([1, 2, 4])
    if size:
        draft.vocab.ids.copy_(torch.tensor(sorted(rng.sample(range(vocab), size))))
    return draft.eval()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    return {"byte": BYTES, "sp": sentencepiece_like(tmp_path_factory.mktemp("genfuzz116"))}


def run_like_cli(tmp_path, model, prompts, limits, *, sampling=GREEDY, eos=(), stops=(), chunk=4096,
                 samples=1, draft=None, spec=None, seeds=None, backend=None, tok=BYTES) -> list[dict]:
    """The JSON lines of generate/cli.py _run's path for one batch (`draft`: speculate_one per prompt and
    sample, as --draft runs them, with `spec` its keyword arguments; `backend`: generate's, InfLLM's)."""
    path = tmp_path / f"out{len(list(tmp_path.iterdir()))}.jsonl"
    rows = [{"text": "", "ids": p} for p in prompts]
    with Output(tok, list(stops), str(path), len(prompts) * samples, sum(limits) * samples, True) as output:
        seeds = seeds if seeds is not None else list(range(len(prompts)))
        output.rows(prompts, 1 if draft is not None else samples)
        if draft is not None:
            results = [speculate_one(model, draft, prompts[0], limits[0], sampling=sampling, eos_ids=eos,
                                     prefill_chunk=chunk, stop=output.stops, seed=seeds[0], **spec)]
        else:
            results = generate(model, prompts, max_new_tokens=limits, sampling=sampling, eos_ids=eos,
                               prefill_chunk=chunk, stop=output.stops, seeds=seeds, num_samples=samples,
                               **({} if backend is None else {"backend": backend}))
        for i, r in enumerate(results):
            output.write(rows[i // samples], r, speculative=draft is not None, samples=samples)
    return [json.loads(line) for line in path.read_text().splitlines()]


def _prompts(rng: random.Random, vocab: int, n: int, tok=None) -> list[list[int]]:
    """n prompts of random ids; with a tokenizer `tok` (of pieces and byte fallback), of random text encoded,
    as the command reads them (their bytes then valid UTF-8: text_after is the row's own text)."""
    lengths = [rng.choice([1, rng.randint(2, 30), rng.randint(2, 200), rng.randint(2, 200)]) for _ in range(n)]
    if n > 2 and rng.random() < 0.4:
        lengths[1] = lengths[0]  # (a length group of two)
    if tok is None:
        return [[rng.randrange(vocab) for _ in range(m)] for m in lengths]
    return [[int(t) for t in tok.encode("".join(rng.choice(TEXT) for _ in range(max(1, m // 2))))] for m in lengths]


def _sampling(rng: random.Random) -> Sampling:
    return rng.choice([Sampling(), Sampling(), Sampling(repetition_penalty=rng.choice([1.3, 0.8])),
                       Sampling(presence_penalty=0.7, frequency_penalty=0.4, min_new_tokens=rng.randint(1, 4))])


def _spec(rng: random.Random, kind: str) -> dict:
    """speculate_one's speculation settings, as the flags give them."""
    k = rng.randint(1, 6)
    return {"k": k, "cape": rng.choice([None, CapeTable.parse(DEFAULT_TABLE), CapeTable.parse("1:2")]),
            "adaptive": rng.random() < 0.4, "draft_cost": rng.choice([None, 0.05, 0.5, 0.9]),
            "stop_below": rng.choice([0.0, 0.0, 0.3]),
            "window": rng.choice([None, 0, 4]) if kind.startswith(("glide", "clover")) else None}


def make_case(i: int, tokenizers: dict) -> dict:
    """Case i: its model, prompts, limits, settings and (drafted) its speculation."""
    rng = random.Random(11600 + i)
    tok = rng.choice([None, None, "byte", "sp"])  # stop strings: a vocabulary of the tokenizer's
    vocab = {None: rng.randint(64, 300), "byte": rng.randint(258, 300), "sp": 290}[tok]
    tok = tokenizers.get(tok)
    model = _model(rng.randrange(4), rng.randint(1, 3), vocab, rng.choice(ARCHES))
    kind = rng.choice((*DRAFTS, "self", "perturbed")) if i % 3 else None  # (a third plain batches)
    prompts = _prompts(rng, vocab, 1 if kind else rng.randint(1, 5), tok if tok is not BYTES else None)
    limits = [rng.choice([0, 1, *[rng.randint(2, 40)] * 12]) for _ in prompts]
    case = {"i": i, "model": model, "prompts": prompts, "limits": limits, "sampling": _sampling(rng),
            "chunk": rng.choice([4096, 4096, 16, 7, 64]), "samples": 1 if kind else rng.choice([1, 1, 2]),
            "kind": kind, "rng": rng, "tok": tok or BYTES}
    free = [reference(model, p, n, case["sampling"])[0] for p, n in zip(prompts, limits)]
    late = [t for f in free for t in f[len(f) // 3:] if t not in f[:len(f) // 3]]  # (an EOS met late)
    case["eos"] = rng.sample(sorted(set(late)), min(len(set(late)), rng.choice([1, 1, 2]))) \
        if late and rng.random() < 0.5 else []
    case["stops"] = _stop_strings(rng, tok, prompts, free) if tok else []
    return case


def _stop_strings(rng: random.Random, tok, prompts, free) -> list[str]:
    """1-2 stop strings, mostly pieces of the free continuations' text (so that they are met)."""
    stops = []
    for _ in range(rng.randint(1, 2)):
        j = rng.randrange(len(prompts))
        text = text_after(tok, prompts[j], free[j]).replace("\ufffd", "")  # (no stop string holds U+FFFD)
        if text and rng.random() < 0.85:
            start = rng.randrange(len(text) // 3, len(text))  # (mostly met late)
            stops.append(text[start:start + rng.choice([1, 2, 3, 5, 8])])
        else:
            stops.append(rng.choice(["zz", "\n", "é"]))
    return stops


@pytest.mark.parametrize("i", range(CASES))
def test_greedy_output_is_the_full_forward_references(i, tmp_path, tokenizers):
    case = make_case(i, tokenizers)
    model, prompts, limits, rng = case["model"], case["prompts"], case["limits"], case["rng"]
    kind, tok = case["kind"], case["tok"]
    draft = _draft(kind, model, rng) if kind else None
    spec = _spec(rng, kind) if kind else None
    lines = run_like_cli(tmp_path, model, prompts, limits, sampling=case["sampling"], eos=case["eos"],
                         stops=case["stops"], chunk=case["chunk"], samples=case["samples"], draft=draft, spec=spec,
                         tok=tok)
    said = {k: v for k, v in case.items() if k not in ("model", "rng")} | {"spec": spec, "cfg": model.cfg}
    assert len(lines) == len(prompts) * case["samples"], said
    for j, line in enumerate(lines):
        prompt, limit = prompts[j // case["samples"]], limits[j // case["samples"]]
        tokens, reason = reference(model, prompt, limit, case["sampling"], case["eos"], case["stops"], tok)
        if reason is None:  # a near-tie: only the sure prefix is compared
            assert line["tokens"][:len(tokens)] == tokens, (j, said)
            continue
        got = {key: line[key] for key in ("tokens", "text", "finish_reason")}
        assert got == expected_line(tok, prompt, tokens, reason, case["stops"]), (j, said)


def _sampled(rng: random.Random) -> Sampling:
    return Sampling(temperature=rng.choice([0.7, 1.0, 1.5]), top_k=rng.choice([0, 0, 20]),
                    top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                    repetition_penalty=rng.choice([1.0, 1.2]), presence_penalty=rng.choice([0.0, 0.5]),
                    min_new_tokens=rng.choice([0, 2]))


@pytest.mark.parametrize("trial", range(6))
def test_a_sampled_prompt_is_the_same_in_any_batch_and_twice(trial):
    """T > 0, each prompt its own seed: its tokens (every sample's) are the same in the whole batch, in a
    shuffled part of it, alone, and in a second run; another seed changes some."""
    rng = random.Random(11610 + trial)
    vocab = rng.randint(64, 300)
    model = _model(rng.randrange(4), rng.randint(1, 3), vocab)
    prompts = _prompts(rng, vocab, rng.randint(3, 5))
    n, samples, sampling = len(prompts), rng.choice([1, 2]), _sampled(rng)
    settings = {"sampling": sampling, "eos_ids": [rng.randrange(vocab)] if rng.random() < 0.5 else [],
                "prefill_chunk": rng.choice([4096, 16]), "num_samples": samples}
    seeds, limits = [rng.randrange(1 << 40) for _ in prompts], [rng.randint(1, 25) for _ in prompts]

    def run(rows, seeds=seeds):
        results = generate(model, [prompts[j] for j in rows], max_new_tokens=[limits[j] for j in rows],
                           seeds=[seeds[j] for j in rows], **settings)
        return {(j, s): results[a * samples + s].tokens for a, j in enumerate(rows) for s in range(samples)}

    whole = run(range(n))
    assert run(range(n)) == whole
    part = rng.sample(range(n), rng.randint(2, n))  # (a shuffled subset)
    assert run(part) == {key: whole[key] for key in whole if key[0] in part}, part
    for j in range(n):
        assert run([j]) == {key: whole[key] for key in whole if key[0] == j}, j
    assert run(range(n), [s + 1 for s in seeds]) != whole  # (the draws do come from the seeds)


@pytest.mark.parametrize("kind", ["perturbed", "small", "glide-reduced", "clover"])
def test_a_sampled_speculation_repeats_with_its_seed(kind):
    """T > 0 with a draft: the same seed gives the same tokens twice (a fresh drafter each time, as each
    prompt and sample of the command gets one); other seeds give others."""
    rng = random.Random(11620 + DRAFTS.index(kind))
    vocab = rng.randint(64, 300)
    model = _model(rng.randrange(4), rng.randint(2, 3), vocab)
    draft, prompt, sampling = _draft(kind, model, rng), _prompts(rng, vocab, 1)[0], _sampled(rng)
    spec = {"k": rng.randint(2, 5), "adaptive": rng.random() < 0.5, "draft_cost": 0.3,
            "stop_below": rng.choice([0.0, 0.3]), "sampling": sampling, "eos_ids": [], "prefill_chunk": 4096}

    def run(seed):
        return speculate_one(model, draft, prompt, 24, seed=seed, **spec).tokens

    first = run(7)
    assert len(first) == 24 and run(7) == first
    assert any(run(seed) != first for seed in (8, 9))


def _infllm_case(rng: random.Random, every_unit: bool) -> dict:
    """A prompt, its limit and an InfLLM shape the command takes (a block dividing a window within the
    prompt); `every_unit`: ordered, with a top-k of at least every unit the row will form."""
    from longctx.models.context_memory import InfLLMShape

    block = rng.choice([2, 4, 8])
    window = block * rng.randint(1, 4)
    n, limit = rng.randint(window, 200), rng.randint(1, 40)
    init = rng.choice([0, 1, 4])
    topk = (n + limit) // block + 1 if every_unit else rng.randint(1, 3)
    positions = "ordered" if every_unit else rng.choice(["shared", "ordered"])
    shape = InfLLMShape(block=block, repr=rng.randint(1, 2), topk=topk, window=window, init=init, positions=positions)
    arch = rng.choice([a for a in ARCHES if "--model.rope_ms_poe=true" not in a])
    vocab = rng.randint(64, 300)
    return {"model": (rng.randrange(4), rng.randint(1, 3), vocab, arch), "shape": shape, "limit": limit,
            "prompt": [rng.randrange(vocab) for _ in range(n)], "chunk": rng.choice([4096, 4, 7])}


@pytest.mark.parametrize("trial", range(8))
def test_infllm_retrieving_every_unit_is_the_full_forward(trial, tmp_path):
    """InfLLM's memory, ordered, retrieving every unit: plain attention (models/context_memory.py), so the
    full forward's greedy tokens, units forming during prefill and decode."""
    from longctx.generate.context_memory import InfLLMGeneration

    case = _infllm_case(random.Random(11630 + trial), every_unit=True)
    model, prompt, limit = _model(*case["model"]), case["prompt"], case["limit"]
    line, = run_like_cli(tmp_path, model, [prompt], [limit], chunk=case["chunk"],
                         backend=InfLLMGeneration(case["shape"]))
    tokens, reason = reference(model, prompt, limit)
    assert line["tokens"][:len(tokens)] == tokens, case
    assert reason is None or line["finish_reason"] == reason, case


def _sharded_cases() -> list[dict]:
    """Random cases for 2 ranks: a plain batch (either layout), a speculation with a draft (a GliDe draft
    reads the sharded target cache), InfLLM's memory (ctx)."""
    cases = []
    for i in range(6):
        rng = random.Random(11640 + i)
        if i % 3 == 2:
            case = _infllm_case(rng, every_unit=False) | {"layout": "ctx", "what": "infllm"}
            case |= {"prompts": [case.pop("prompt")], "limits": [case.pop("limit")]}
        else:
            vocab = rng.randint(64, 300)
            arch = rng.choice([a for a in ARCHES if not any("moe" in x or "ms_poe" in x for x in a)])
            model = (rng.randrange(4), rng.randint(1, 3), vocab, arch)
            what = rng.choice(["glide", "perturbed"]) if i % 3 else "plain"
            prompts = _prompts(rng, vocab, 1 if what != "plain" else rng.randint(2, 4))
            case = {"model": model, "prompts": prompts, "limits": [rng.randint(1, 30) for _ in prompts],
                    "chunk": 4096, "layout": rng.choice(["ctx", "head"]), "what": what,
                    "spec": {"k": rng.randint(1, 5), "adaptive": rng.random() < 0.5, "draft_cost": 0.3,
                             "cape": rng.choice([None, CapeTable.parse(DEFAULT_TABLE)])}}
        cases.append(case | {"draft_seed": 11650 + i})
    return cases


def _decode(case: dict, backend) -> list[int]:
    """Greedy tokens of each prompt of `case` on `backend` (None: one process; an InfLLM case builds its own)."""
    model = _model(*case["model"])
    if case["what"] == "infllm":
        if backend is None:
            from longctx.generate.context_memory import InfLLMGeneration

            backend = InfLLMGeneration(case["shape"])
        results = generate(model, case["prompts"], max_new_tokens=case["limits"], prefill_chunk=case["chunk"],
                           backend=backend)
    elif case["what"] == "plain":
        results = generate(model, case["prompts"], max_new_tokens=case["limits"],
                           **({} if backend is None else {"backend": backend}))
    else:
        draft = _draft(case["what"], model, random.Random(case["draft_seed"]))
        results = [speculate_one(model, draft, case["prompts"][0], case["limits"][0], sampling=Sampling(),
                                 eos_ids=[], prefill_chunk=4096, **case["spec"],
                                 **({} if backend is None else {"backend": backend}))]
    return [r.tokens for r in results]


def _sharded_rank(cases: list[dict]) -> list[list[list[int]]]:
    """On each of 2 ranks: every case's tokens under its layout (head 2 or ctx 2)."""
    from longctx.generate.sharded import ShardedGeneration
    from longctx.generate.sharded_infllm import ShardedInfLLMGeneration
    from longctx.job.runtime import Runtime

    out, runtimes = [], {}
    for case in cases:
        layout = case["layout"]
        if layout not in runtimes:
            runtimes[layout] = Runtime.create(load_config(overrides=[f"--parallel.{layout}=2"]),
                                              torch.distributed.get_rank(), 2, "cpu")
        rt = runtimes[layout]
        backend = ShardedInfLLMGeneration(case["shape"], rt.mesh) if case["what"] == "infllm" else \
            ShardedGeneration(rt.mesh, rt.world_mesh)
        out.append(_decode(case, backend))
    return out


@pytest.mark.slow
def test_two_ranks_decode_as_one_process():
    """ctx- or head-sharded generation (plain batches, chain and CaPE speculation with GliDe or a model draft)
    and ctx-sharded InfLLM, on 2 gloo ranks: every rank the one process's tokens; those of the plain and
    speculative cases the full forward's too."""
    from longctx.job.spawn import run_spawned

    cases = _sharded_cases()
    ranks = run_spawned(2, _sharded_rank, cases)
    for case, got0, got1 in zip(cases, *ranks):
        said = {k: v for k, v in case.items() if k != "prompts"}
        assert got0 == got1 == _decode(case, None), said
        if case["what"] != "infllm":
            for prompt, limit, tokens in zip(case["prompts"], case["limits"], got0):
                sure, _ = reference(_model(*case["model"]), prompt, limit)
                assert tokens[:len(sure)] == sure, said
