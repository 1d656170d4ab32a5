"""A randomized audit of speculative decoding (specfuzz, 121) against independent references
(tests/specfuzz121_reference.py, tests/generate_reference.py): every decision a full forward without a cache;
the cache checks against a fresh prefill of the tokens a cache should hold.

Greedy (CASES seeded cases, tiny random targets and drafts of other shapes: the target itself, a perturbed
copy, a smaller model, GliDe and Clover drafts with the full or a reduced vocabulary, a prompt window or not;
a chain of K 1..5 or CaPE's tree, fixed or adaptive K, a confidence stop or not, penalties and min_new_tokens,
EOS, byte-text stop strings, limits landing anywhere in a round; 1-3 ragged prompts, one at a time as
`longctx generate --draft` runs them, and together through plain `generate`):
1. each JSON line's tokens, text and finish reason are plain greedy decoding's by full forwards;
3. each round's kept and made proposals, the K it was given, `unused` and tau are the reference's rounds'
   (a plain draft's proposals from its own full forwards; GliDe's and Clover's as the drafter made them);
4. after every round the target's cache holds the prompt and every token but the pending one, equal to a
   fresh prefill of them (and a plain draft's cache a fresh prefill of the prefix it was fed).
Sampling (SAMPLED, fixed seeds, so nothing can flake): 2. the target's p and a plain draft's q at the first
round are the references' processed distributions; over RUNS seeded generations the first two tokens' joint
and the third's marginal follow the target's processed distribution (chi-square p > P_MIN), and the first
proposal is kept as often as the rule's sum of min(p, q) says (a plain draft: within 5 standard deviations).
Also (slow, one spawn of 2 gloo ranks): the target's cache sharded over ctx 2 and head 2 gives every rank the
references' tokens and rounds. Found: a chain's confidence stop read the raw softmax at T = 0 (the regression
test last)."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch

from generate_reference import BYTES, expected_line, reference, text_after
from longctx.config import load_config
from longctx.generate import cape as cape_mod
from longctx.generate import speculative as sp
from longctx.generate.cape import CapeTable
from longctx.generate.drafters import ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.output import Output
from longctx.generate.sampling import Sampling
from longctx.models.clover import CloverDraft
from longctx.models.glide import GlideDraft
from longctx.models.llama import build_model
from specfuzz121_reference import (
    Adaptive,
    NearTie,
    Watched,
    chisquare_p,
    greedy_spec,
    plain_proposals,
    step1,
    step2_probs,
    tau,
)

CASES, PARTS = 36, 3
KINDS = ("self", "perturbed", "small", "glide", "glide-reduced", "clover", "clover-reduced")
TABLES = ("0.3:3,0.6:2,0.9:1,1:0", "1:2", "0.5:1,1:0")


def _model(seed, vocab, layers=2, dim=64, heads=4, kv_heads=2, sharp=4.0):
    cfg = load_config(overrides=[f"--model.layers={layers}", f"--model.vocab_size={vocab}", f"--model.dim={dim}",
                                 f"--model.heads={heads}", f"--model.kv_heads={kv_heads}",
                                 f"--model.ffn_dim={2 * dim}"]).model
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():  # (a sharper head: fewer near-ties, longer runs the draft can agree on)
        model.lm_head_weight.mul_(sharp)
    return model


def _draft(kind, target, rng):
    vocab = target.cfg.vocab_size
    if kind == "self":
        return target
    if kind == "perturbed":
        draft = copy.deepcopy(target)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 20))
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.03 * p.std())
        return draft
    if kind == "small":  # another shape: one layer, dim 32, MQA
        return _model(rng.randrange(100, 200), vocab, layers=1, dim=32, heads=2, kv_heads=1)
    size = rng.randrange(max(3, vocab // 3), vocab // 2 + 1) if kind.endswith("reduced") else 0
    if kind.startswith("glide"):
        draft = GlideDraft(target.cfg, layers=rng.randint(1, target.cfg.layers), vocab=size)
        draft.init_weights(seed=rng.randrange(99), std=0.05)
    else:
        draft = CloverDraft(target.cfg, vocab=size).init_weights(seed=rng.randrange(99), std=0.1)
    draft.block = rng.choice([1, 2, 4])
    if size:
        draft.vocab.ids.copy_(torch.tensor(sorted(rng.sample(range(vocab), size))))
    return draft.eval()


def make_case(i: int) -> dict:
    """Case i, drawn again (seeded by the attempt) while a reference decision is a near-tie."""
    for attempt in range(20):
        rng = random.Random(121_000 + 100 * i + attempt)
        vocab = rng.randint(48, 120)  # (byte ids < 128: ASCII, one character each)
        # (a head 40x sharper: a confident draft, whose confidence stop the penalties decide)
        target = _model(rng.randrange(50), vocab, layers=rng.randint(1, 2), sharp=rng.choice([4.0, 4.0, 40.0]))
        kind = KINDS[i % len(KINDS)]
        prompts = [[rng.randrange(vocab) for _ in range(rng.choice([1, rng.randint(2, 12), rng.randint(13, 60)]))]
                   for _ in range(rng.randint(1, 3))]
        case = {"i": i, "kind": kind, "target": target, "prompts": prompts, "rng": rng,
                "limits": [rng.choice([1, 2, rng.randint(3, 12), rng.randint(12, 30)]) for _ in prompts],
                "sampling": rng.choice([Sampling(), Sampling(repetition_penalty=rng.choice([1.4, 0.8])),
                                        Sampling(presence_penalty=0.6, frequency_penalty=0.3,
                                                 min_new_tokens=rng.randint(1, 4))]),
                "k": rng.randint(1, 5), "cape": CapeTable.parse(rng.choice(TABLES)) if rng.random() < 0.35 else None,
                "adaptive": rng.random() < 0.45, "c": rng.choice([0.05, 0.3, 0.9]), "w": rng.choice([0.0, 0.2]),
                "stop_below": rng.choice([0.0, 0.0, 0.35, 0.6]),
                "window": rng.choice([None, 0, 3]) if kind.startswith(("glide", "clover")) else None}
        try:
            free = [_sure(reference(target, p, n, case["sampling"])) for p, n in zip(prompts, case["limits"])]
            late = sorted({t for f in free for t in f[len(f) // 2:] if t not in f[:len(f) // 2]})
            case["eos"] = [rng.choice(late)] if late and rng.random() < 0.4 else []
            case["stops"] = _stops(rng, prompts, free) if rng.random() < 0.6 else []
            case["draft"] = _draft(kind, target, rng)
            case["expected"] = [_expected(case, j) for j in range(len(prompts))]
            return case
        except NearTie:
            continue
    raise AssertionError(f"case {i}: 20 draws all near-tied")


def _sure(result):
    tokens, reason = result
    if reason is None:
        raise NearTie("target")
    return tokens


def _stops(rng, prompts, free):
    """1-2 stop strings cut from the free continuations' text, 2-4 characters: they cross round boundaries."""
    stops = []
    for _ in range(rng.randint(1, 2)):
        j = rng.randrange(len(prompts))
        text = text_after(BYTES, prompts[j], free[j])
        if len(text) > 3:
            start = rng.randrange(1, len(text) - 2)
            stops.append(text[start:start + rng.randint(2, 4)])
    return stops or ["zz"]


def _expected(case, j):
    """The reference's line for prompt j (the plain greedy reference) and, for a plain draft model, its rounds."""
    target, prompt, limit, s = case["target"], case["prompts"][j], case["limits"][j], case["sampling"]
    tokens, reason = reference(target, prompt, limit, s, case["eos"], case["stops"], BYTES)
    if reason is None:
        raise NearTie("target")
    line = expected_line(BYTES, prompt, tokens, reason, case["stops"])
    if case["kind"] in ("self", "perturbed", "small"):
        rounds = _reference_rounds(case, j, lambda out, k: plain_proposals(
            case["draft"], prompt, out, k, s, case["eos"], case["stop_below"], case["cape"]))
        assert (rounds[0], rounds[1]) == (tokens, reason), "the two references disagree"
        line["book"] = rounds[2]
    return line


def _reference_rounds(case, j, proposer):
    prompt, stops = case["prompts"][j], case["stops"]
    adaptive = Adaptive(case["k"], case["c"], case["w"], probe=2) if case["adaptive"] else None
    return greedy_spec(case["target"], prompt, case["limits"][j], case["sampling"], case["eos"],
                       lambda out: any(s in text_after(BYTES, prompt, out) for s in stops), proposer, case["k"],
                       adaptive, case["cape"])


def run_case(case, tmp_path, monkeypatch) -> list[dict]:
    """Each prompt as `longctx generate --draft` runs it (generate/cli.py _speculate, speculate_one's steps, with
    an AdaptiveLength of probes every 2 plain rounds to read its choices), its JSON line through Output, and
    what the rounds did: the proposals each propose call was asked for and made, the cache checks."""
    made, watched = [], []
    propose, tree = ModelDrafter.propose, cape_mod.propose_tree

    def recording_propose(self, pending, k, *args, **kwargs):
        out = propose(self, pending, k, *args, **kwargs)
        made.append((k, list(out[0])))
        return out

    def recording_tree(drafter, pending, k, table, *args, **kwargs):
        t = tree(drafter, pending, k, table, *args, **kwargs)
        made[-1] += ([[t.tokens[n] for n in range(1, len(t.tokens)) if t.depths[n] == d and n not in t.chain]
                      for d in range(1, len(t.chain) + 1)],)
        return t

    def watching_decode(model, prompts, rounds, **kwargs):
        watched.append(Watched(rounds, model, prompts[0]))
        return decode(model, prompts, watched[-1], **kwargs)

    decode = sp.decode
    monkeypatch.setattr(ModelDrafter, "propose", recording_propose)
    monkeypatch.setattr(cape_mod, "propose_tree", recording_tree)
    monkeypatch.setattr(sp, "decode", watching_decode)
    target, lines = case["target"], []
    with Output(BYTES, case["stops"], str(tmp_path / f"c{case['i']}.jsonl"), 1, 1, True) as output:
        for j, (prompt, limit) in enumerate(zip(case["prompts"], case["limits"])):
            made.clear()
            output.rows([prompt])
            drafter = sp.drafter_for(target, case["draft"], len(prompt) + limit + case["k"] + 2, 4096,
                                     case["window"])
            length = sp.AdaptiveLength(case["k"], case["c"], verify_cost=case["w"], probe_every=2) \
                if case["adaptive"] else False
            r = sp.speculative_generate(target, drafter, prompt, max_new_tokens=limit, k=case["k"],
                                        sampling=case["sampling"], eos_ids=case["eos"], cape=case["cape"],
                                        stop_below=case["stop_below"], adaptive=length, stop=output.stops, seed=j)
            output.write({"ids": prompt, "text": ""}, r, speculative=True)
            lines.append({"result": r, "made": list(made), "watched": watched[-1],
                          "ks": length.chosen if length else None})
    for line, text in zip(lines, (tmp_path / f"c{case['i']}.jsonl").read_text().splitlines()):
        line["json"] = json.loads(text)
    return lines


def _recorded(made):
    """A proposer of the rounds' proposals as the drafter made them (GliDe, Clover: no reference of their own
    here), each round's K checked against the one the reference's rounds ask for."""
    entries = iter(made)

    def proposer(out, k):
        entry = next(entries)
        assert entry[0] == k, f"the round was given K = {entry[0]}, the reference's rule {k}"
        return entry[1], entry[2] if len(entry) > 2 else None
    return proposer


def check_case(case, lines) -> list[str]:
    """What differs between the engine's lines and rounds and the references' (empty: nothing)."""
    wrong = []
    for j, (line, want) in enumerate(zip(lines, case["expected"])):
        got = {key: line["json"][key] for key in ("tokens", "text", "finish_reason")}
        if got != {key: want[key] for key in got}:
            wrong.append(f"prompt {j}: line {got} != reference {want}")
            continue
        book = want.get("book")
        if book is None:
            try:
                book = _reference_rounds(case, j, _recorded(line["made"]))[2]
            except NearTie:
                continue
        r = line["result"]
        if "book" in want and [tuple(m) for m in line["made"]] != [tuple(m) for m in book["trees"]]:
            wrong.append(f"prompt {j}: (K, chain, alternatives) {line['made']} != reference {book['trees']}")
        counts = {"kept": r.accepted, "made": r.proposed, "unused": r.unused}
        if counts != {key: book[key] for key in counts}:
            wrong.append(f"prompt {j}: rounds {counts} != reference {book}")
        if line["ks"] is not None and line["ks"] != book["ks"]:
            wrong.append(f"prompt {j}: adaptive K {line['ks']} != reference {book['ks']}")
        if (line["json"]["tau"], line["json"]["target_passes"]) != (round(tau(book), 3), len(book["kept"])):
            wrong.append(f"prompt {j}: tau {line['json']['tau']} passes {line['json']['target_passes']} != "
                         f"{tau(book):.3f}, {len(book['kept'])}")
        if not line["watched"].lengths_ok or line["watched"].worst > 1e-5:
            wrong.append(f"prompt {j}: the cache after a round is no fresh prefill's (lengths ok "
                         f"{line['watched'].lengths_ok}, largest difference {line['watched'].worst:.2g})")
    return wrong


def _plain_batch(case, tmp_path) -> list[str]:
    """The case's prompts as one ragged batch through plain `generate` (the same lines as the reference)."""
    path = tmp_path / f"plain{case['i']}.jsonl"
    prompts = case["prompts"]
    with Output(BYTES, case["stops"], str(path), len(prompts), 1, True) as output:
        output.rows(prompts)
        results = generate(case["target"], prompts, max_new_tokens=case["limits"], sampling=case["sampling"],
                           eos_ids=case["eos"], stop=output.stops)
        for prompt, r in zip(prompts, results):
            output.write({"ids": prompt, "text": ""}, r, speculative=False)
    got = [json.loads(t) for t in path.read_text().splitlines()]
    return [f"plain batch row {j}: {g} != {w}" for j, (g, w) in enumerate(zip(got, case["expected"]))
            if {k: g[k] for k in ("tokens", "text", "finish_reason")} != {k: w[k] for k in ("tokens", "text",
                                                                                           "finish_reason")}]


def _features(case, lines) -> set[str]:
    seen = {case["kind"], "cape" if case["cape"] else "chain", "adaptive" if case["adaptive"] else "fixed"}
    for line in lines:
        r = line["result"]
        seen |= {r.finish_reason, *(["inside a round"] if r.unused else []), *(["plain step"] if 0 in r.proposed
                                                                               else []),
                 *(["batch"] if len(case["prompts"]) > 1 else [])}
    return seen


@pytest.mark.parametrize("part", range(PARTS))
def test_greedy_speculation_is_the_references_tokens_rounds_and_cache(part, tmp_path, monkeypatch):
    wrong, seen = [], set()
    for i in range(part * CASES // PARTS, (part + 1) * CASES // PARTS):  # (12 in a row: every kind)
        case = make_case(i)
        with monkeypatch.context() as patch:
            lines = run_case(case, tmp_path, patch)
        said = {k: case[k] for k in ("i", "kind", "prompts", "limits", "sampling", "k", "cape", "adaptive", "c", "w",
                                     "stop_below", "window", "eos", "stops")}
        wrong += [f"{said}: {w}" for w in check_case(case, lines) + _plain_batch(case, tmp_path)]
        seen |= _features(case, lines)
    assert not wrong, "\n".join(wrong)
    assert seen >= {*KINDS, "cape", "chain", "adaptive", "fixed", "stop", "length", "inside a round", "batch"}, seen


def _sharded_rank(layouts: list[str]) -> list:
    """On each of 2 ranks, under each layout (ctx 2, head 2): SHARDED's cases (plain and GliDe drafts) as
    run_case runs them, without the cache checks (the cache is sharded): each prompt's tokens, reason and rounds."""
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime

    out = []
    for layout in layouts:
        rt = Runtime.create(load_config(overrides=[f"--parallel.{layout}=2"]), torch.distributed.get_rank(), 2, "cpu")
        for i in SHARDED:
            case = make_case(i)
            for j, (prompt, limit) in enumerate(zip(case["prompts"], case["limits"])):
                drafter = sp.drafter_for(case["target"], case["draft"], len(prompt) + limit + case["k"] + 2, 4096,
                                         case["window"])
                length = sp.AdaptiveLength(case["k"], case["c"], verify_cost=case["w"], probe_every=2) \
                    if case["adaptive"] else False
                stop = (lambda _row, toks, p=prompt, s=case["stops"]: any(x in text_after(BYTES, p, toks) for x in s))
                r = sp.speculative_generate(case["target"], drafter, prompt, max_new_tokens=limit, k=case["k"],
                                            sampling=case["sampling"], eos_ids=case["eos"], cape=case["cape"],
                                            stop_below=case["stop_below"], adaptive=length, stop=stop, seed=j,
                                            backend=ShardedGeneration(rt.mesh, rt.world_mesh))
                out.append((layout, i, j, r.tokens, r.finish_reason, r.accepted, r.proposed, r.unused))
    return out


SHARDED = [i for i in range(CASES) if KINDS[i % len(KINDS)] in ("self", "perturbed", "small", "glide")][:8]


@pytest.mark.slow
def test_sharded_speculation_is_the_references_tokens_and_rounds():
    """The target's cache sharded over 2 gloo ranks (ctx 2, head 2; one spawn): every rank's tokens, finish
    reasons and rounds (kept, made, unused) are the references', as on one process."""
    from longctx.job.spawn import run_spawned

    ranks = run_spawned(2, _sharded_rank, ["ctx", "head"])
    assert ranks[0] == ranks[1]
    cases = {i: make_case(i) for i in SHARDED}
    for layout, i, j, tokens, reason, kept, made, unused in ranks[0]:
        want = cases[i]["expected"][j]
        assert (tokens, reason) == (want["tokens"], want["finish_reason"]), (layout, i, j)
        if "book" in want:
            assert (kept, made, unused) == (want["book"]["kept"], want["book"]["made"], want["book"]["unused"]), \
                (layout, i, j, kept, made, want["book"])


RUNS, P_MIN, V = 800, 1e-3, 8
SAMPLED = {  # kind, sampling, K, adaptive, confidence stop, EOS
    "small-topk": ("small", Sampling(temperature=0.9, top_k=5), 3, False, 0.0, []),
    "perturbed-adaptive-topp": ("perturbed", Sampling(temperature=1.0, top_p=0.85, repetition_penalty=1.3), 2, True,
                                0.3, []),
    "glide-reduced-minp-eos": ("glide-reduced", Sampling(temperature=1.1, min_p=0.05, presence_penalty=0.5,
                                                         frequency_penalty=0.3, min_new_tokens=1), 3, False, 0.0, [7]),
    "clover-topk-topp": ("clover", Sampling(temperature=0.8, top_k=6, top_p=0.9), 2, False, 0.0, []),
}


def _sampled_setup(name):
    kind, s, k, adaptive, stop_below, eos = SAMPLED[name]
    rng = random.Random(name)
    target = _model(rng.randrange(50), V, layers=1, dim=32, heads=2, kv_heads=1, sharp=3.0)
    return kind, s, k, adaptive, stop_below, eos, target, _draft(kind, target, rng), [3, 1, 4, 1, 5]


def _speculate(target, draft, prompt, s, k, adaptive, stop_below, eos, seed, limit=3):
    drafter = sp.drafter_for(target, draft, len(prompt) + limit + k + 2, 4096, None)
    length = sp.AdaptiveLength(k, 0.2, probe_every=2) if adaptive else False
    return sp.speculative_generate(target, drafter, prompt, max_new_tokens=limit, k=k, sampling=s, eos_ids=eos,
                                   adaptive=length, stop_below=stop_below, seed=seed)


def _dist(model, prompt, out, s, eos) -> np.ndarray:
    return step2_probs(step1(model, prompt, out, s, eos), s).numpy()


@pytest.mark.slow  # (800 seeded generations a case: 6-13 s each on the 2-core CPU, 25-50 s loaded)
@pytest.mark.parametrize("name", list(SAMPLED))
def test_sampled_speculation_keeps_the_targets_processed_distribution(name, monkeypatch):
    kind, s, k, adaptive, stop_below, eos, target, draft, prompt = _sampled_setup(name)
    seen, accept = [], sp.accept
    monkeypatch.setattr(sp, "accept", lambda props, q, p, *a: seen.append((props, q, p)) or accept(props, q, p, *a))
    first = _speculate(target, draft, prompt, s, k, adaptive, stop_below, eos, seed=0).tokens[0]
    props, q, p = seen[0]
    for i in range(len(props) + 1):  # 2: the rule's p and q are the processed distributions
        assert np.abs(p[i].numpy() - _dist(target, prompt, [first, *props[:i]], s, eos)).max() < 1e-5, (name, i)
        if kind in ("small", "perturbed") and i < len(props):
            assert np.abs(q[i].numpy() - _dist(draft, prompt, [first, *props[:i]], s, eos)).max() < 1e-5, (name, i)
    monkeypatch.setattr(sp, "accept", accept)
    p1 = _dist(target, prompt, [], s, eos)
    pair, third, kept_first = np.zeros((V, V)), np.zeros(V), 0.0
    for a in np.flatnonzero(p1):
        p2 = _dist(target, prompt, [int(a)], s, eos)
        pair[a] = p1[a] * p2
        for b in np.flatnonzero(p2):
            third += pair[a, b] * (np.eye(V)[b] if b in eos else _dist(target, prompt, [int(a), int(b)], s, eos))
        if kind in ("small", "perturbed"):  # the chance the first proposal is kept: sum of min(p, q)
            kept_first += p1[a] * np.minimum(p2, _dist(draft, prompt, [int(a)], s, eos)).sum()
    got_pair, got_third, kept = np.zeros((V, V)), np.zeros(V), 0
    for seed in range(RUNS):
        r = _speculate(target, draft, prompt, s, k, adaptive, stop_below, eos, seed)
        tokens = (r.tokens + eos * 3)[:3]
        got_pair[tokens[0], tokens[1]] += 1
        got_third[tokens[2]] += 1
        kept += bool(r.accepted and r.accepted[0])
    p_pair, p_third = chisquare_p(got_pair.ravel(), pair.ravel()), chisquare_p(got_third, third)
    print(f"{name}: pair p {p_pair:.3g}, third p {p_third:.3g}, first kept {kept} (expected {RUNS * kept_first:.1f})")
    assert p_pair > P_MIN and p_third > P_MIN, (p_pair, p_third)
    if kept_first:  # 3 under sampling: a plain draft's acceptance is the rule's
        assert abs(kept - RUNS * kept_first) <= 5 * (RUNS * kept_first * (1 - kept_first)) ** 0.5 + 1


def test_a_chains_confidence_stop_reads_the_penalised_softmax():
    """Regression (found by the audit above): at T = 0 a chain's confidence stop read the draft's raw softmax,
    not that of the penalised logits its proposal was chosen from (as CaPE's tree reads it): a self draft, which
    keeps every proposal, stopped each round after one under a repetition penalty (12 passes, tau 1.92, for the
    reference's 5 passes, tau 4.6)."""
    target = _model(29, 64, layers=1, sharp=60.0)
    s, prompt = Sampling(repetition_penalty=0.6), [(29 * 7 + 3 * j) % 64 for j in range(10)]
    r = sp.speculative_generate(target, ModelDrafter(target, 60), prompt, max_new_tokens=24, k=4, sampling=s,
                                stop_below=0.5)
    out, reason, book = greedy_spec(target, prompt, 24, s, [], lambda out: False, lambda out, k: plain_proposals(
        target, prompt, out, k, s, [], 0.5), 4)
    assert (r.tokens, r.finish_reason) == (out, reason)
    assert (r.proposed, r.accepted) == (book["made"], book["kept"]) and r.tau > 4, (r.proposed, book["made"])


def test_adaptive_length_is_the_docs_rule_on_random_histories():
    """spec_length.AdaptiveLength against the reference's rule, fed the same random rounds (kept, made, verified
    of drafts good and bad, chains and trees): the same K every round, probes included."""
    for trial in range(40):
        rng = random.Random(trial)
        cap, c, w = rng.randint(1, 8), rng.choice([0.02, 0.1, 0.3, 0.9]), rng.choice([0.0, 0.1, 0.4])
        good, tree = rng.random(), rng.random() < 0.5
        ours, theirs = sp.AdaptiveLength(cap, c, verify_cost=w, probe_every=rng.choice([1, 2, 16])), None
        theirs = Adaptive(cap, c, w, probe=ours.probe_every)
        for step in range(120):
            k = theirs.next()
            assert ours.next() == k, (trial, step, ours.chosen, theirs.__dict__)
            made = rng.randint(1, k) if k else 0  # (a confidence stop may make fewer)
            kept = next((i for i in range(made) if rng.random() > good), made)
            verified = made + (sum(rng.randint(0, 3) for _ in range(made)) if tree else 0)
            ours.observe(kept, made, verified)
            theirs.observe(kept, made, verified)
