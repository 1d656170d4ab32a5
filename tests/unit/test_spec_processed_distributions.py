"""The distributions every decoding draws from, checked position by position (deterministic: no
chi-square, which cannot see a temperature 10% off):
- speculative decoding (a plain draft model, a GliDe draft, a Clover draft, a GliDe draft with a reduced
  vocabulary; adaptive K with plain steps): the target's p handed to the acceptance rule at verified
  position i equals sampling.py's processed distribution (temperature, top-k, top-p, min-p, the penalties,
  min_new_tokens) of a full, uncached forward over the prompt, the tokens emitted before and the proposals
  d_1..d_i; the draft's q equals its raw logits processed with the same settings and the same history; a
  plain step's and the first token's distribution is the same processed one;
- CaPE's tree (greedy only): each node's logits the greedy choice is made from are the penalised logits
  of a full forward of the node's path;
- plain decoding (a batch of two prompts of different lengths): each row draws from that same processed
  distribution;
- each check fails when the temperature one path uses is 10% off (the check can fail)."""

import pytest
import torch
from test_speculative import _model, _prompt

import longctx.generate.acceptance as acceptance_mod
import longctx.generate.cape as cape_mod
import longctx.generate.drafters as drafters_mod
import longctx.generate.engine as engine_mod
import longctx.generate.speculative as spec_mod
from longctx.generate.acceptance import sampling_probs
from longctx.generate.cape import CapeTable
from longctx.generate.drafters import CloverDrafter, GlideDrafter, ModelDrafter
from longctx.generate.sampling import Processors, Sampling, process
from longctx.generate.spec_length import AdaptiveLength
from longctx.models.clover import CloverDraft
from longctx.models.glide import GlideDraft

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, EOS, TOL = 64, 5, 1e-6
S = Sampling(temperature=0.7, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.2, presence_penalty=0.3,
             frequency_penalty=0.2, min_new_tokens=3, seed=11)
PROMPT = _prompt(12, vocab=VOCAB, seed=4)
IDS = list(range(0, VOCAB, 3))  # a reduced draft vocabulary


def _target():
    target = _model(1, layers=2, vocab=VOCAB, dim=32)
    with torch.no_grad():
        target.lm_head_weight.mul_(4.0)  # some conviction, so that top-p and min-p cut
    return target


def _reference(model, tokens, generated, sampling=S, greedy_logits=False):
    """sampling.py's processed distribution after PROMPT + `generated` (a full forward of `tokens`)."""
    state = Processors(sampling, [PROMPT], VOCAB, [EOS], "cpu")
    for t in generated:
        state.chosen(torch.tensor([t]))
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]))[:, -1].float()
    if greedy_logits:
        return process(logits, sampling, state)[0]
    return sampling_probs(logits, sampling, state)[0]


def _processed_q(raw, generated):
    state = Processors(S, [PROMPT], VOCAB, [EOS], "cpu")
    for t in generated:
        state.chosen(torch.tensor([t]))
    return sampling_probs(raw[None].float(), S, state)[0]


def _close(got, want, what):
    gap = float((got.double() - want.double()).abs().max())
    assert gap <= TOL, f"{what}: the distribution differs from sampling.py's processed one by {gap:.3g}"


def _drafter(kind, target):
    if kind == "model":
        return ModelDrafter(_model(2, layers=1, vocab=VOCAB, dim=32), 200)
    vocab = len(IDS) if kind.endswith("reduced") else 0
    if kind.startswith("glide"):
        draft = GlideDraft(target.cfg, 1, vocab=vocab).init_weights(seed=3, std=0.3)
    else:
        draft = CloverDraft(target.cfg, vocab=vocab).init_weights(seed=3, std=0.3)
    if vocab:
        draft.vocab.ids.copy_(torch.tensor(IDS))
    cls = GlideDrafter if kind.startswith("glide") else CloverDrafter
    return cls(draft.eval(), target, 200, 2)


class _Recorder:
    """Records, in order, the first token's and plain steps' distributions (speculative.choose), each
    round's proposals, q and p (speculative.accept) and the draft's raw logits of each proposal."""

    def __init__(self, monkeypatch, drafter):
        self.events, self.raw = [], []
        choose, accept, logits = spec_mod.choose, spec_mod.accept, drafter._logits

        def recording_choose(probs, sampling, generator):
            token = choose(probs, sampling, generator)
            self.events.append(("choose", probs.clone(), token))
            return token

        def recording_accept(proposals, q, p, sampling, generator):
            kept, following = accept(proposals, q, p, sampling, generator)
            self.events.append(("accept", list(proposals), q.clone(), p.clone(), kept, following,
                                self.raw[-len(proposals):]))
            return kept, following

        def recording_logits(tokens):
            out = logits(tokens)
            self.raw.append(out.detach().clone())
            return out

        monkeypatch.setattr(spec_mod, "choose", recording_choose)
        monkeypatch.setattr(spec_mod, "accept", recording_accept)
        monkeypatch.setattr(drafter, "_logits", recording_logits)


def _check_speculative(target, recorder, draft_model=None):
    """Each recorded distribution against the reference; how many positions were checked."""
    emitted, checked = [], 0
    for event in recorder.events:
        if event[0] == "choose":
            _, probs, token = event
            _close(probs, _reference(target, PROMPT + emitted, emitted), f"a plain step after {len(emitted)} tokens")
            emitted.append(token)
            checked += 1
            continue
        _, proposals, q, p, kept, following, raw = event
        assert len(raw) == len(proposals) == len(q) == len(p) - 1
        for i in range(len(proposals) + 1):
            history = emitted + proposals[:i]
            _close(p[i], _reference(target, PROMPT + history, history), f"the target's p at verified position {i}")
            if i < len(proposals):
                _close(q[i], _processed_q(raw[i], history), f"the draft's q at proposal {i + 1}")
                if draft_model is not None:  # (the raw logits too, where the draft reads nothing of the target)
                    with torch.inference_mode():
                        full = draft_model(torch.tensor([PROMPT + history]))[0, -1].float()
                    assert float((raw[i].float() - full).abs().max()) <= 1e-4
            checked += 1
        emitted += proposals[:kept] + [following]
    return checked


class _Scripted(AdaptiveLength):
    """Adaptive K following a schedule with plain steps (K = 0)."""

    def __init__(self, cap):
        super().__init__(cap, 0.1)

    def next(self):
        k = [3, 0, 2, 0, 3][len(self.chosen) % 5]
        self.chosen.append(k)
        return k


@pytest.mark.parametrize("kind", ["model", "glide", "clover", "glide-reduced", "clover-reduced", "adaptive-model",
                                  "adaptive-glide", "adaptive-clover-reduced"])
def test_every_speculative_distribution_is_the_processed_one(kind, monkeypatch):
    target = _target()
    adaptive = kind.startswith("adaptive-")
    drafter = _drafter(kind.removeprefix("adaptive-"), target)
    recorder = _Recorder(monkeypatch, drafter)
    r = spec_mod.speculative_generate(target, drafter, PROMPT, max_new_tokens=24, k=3, sampling=S, eos_ids=[EOS],
                                      adaptive=_Scripted(3) if adaptive else False)
    rounds = [e for e in recorder.events if e[0] == "accept"]
    assert len(r.tokens) >= 10 and rounds and any(e[4] < len(e[1]) for e in rounds)  # some rejections
    if adaptive:
        assert sum(e[0] == "choose" for e in recorder.events) >= 3  # the first token and plain steps
    checked = _check_speculative(target, recorder, drafter.model if kind.endswith("model") else None)
    assert checked >= len(r.tokens)


@pytest.mark.parametrize("path", ["target", "draft", "plain-step"])
def test_the_speculative_check_sees_a_temperature_ten_percent_off(path, monkeypatch):
    """The same check fails when one side's temperature is 10% off: the target's verification (p), the
    draft's proposals (q), or a plain step of adaptive K (and the first token)."""
    from dataclasses import replace

    target = _target()
    drafter = _drafter("model", target)
    off = replace(S, temperature=S.temperature * 1.1)
    if path == "target":
        monkeypatch.setattr(spec_mod, "process", lambda logits, s, state=None: process(logits, off, state))
    elif path == "draft":
        monkeypatch.setattr(drafters_mod, "sampling_probs", lambda logits, s, state=None: sampling_probs(
            logits, off, state))
    else:
        monkeypatch.setattr(spec_mod, "token_probs", lambda processed, s: acceptance_mod.token_probs(
            processed * S.temperature / off.temperature, s) if processed.shape[0] == 1 else
            acceptance_mod.token_probs(processed, s))
    recorder = _Recorder(monkeypatch, drafter)
    spec_mod.speculative_generate(target, drafter, PROMPT, max_new_tokens=16, k=3, sampling=S, eos_ids=[EOS],
                                  adaptive=_Scripted(3) if path == "plain-step" else False)
    with pytest.raises(AssertionError, match="differs from sampling.py's processed one"):
        _check_speculative(target, recorder)


def test_capes_tree_chooses_from_each_nodes_penalised_logits(monkeypatch):
    """CaPE is greedy (sampling refused): each node's logits are its path's penalised ones."""
    target = _target()
    greedy = Sampling(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, min_new_tokens=3)
    noisy = _target()
    with torch.no_grad():
        w = noisy.lm_head_weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * 0.8)
    trees, choice = [], cape_mod.greedy_choice
    propose = cape_mod.propose_tree

    def recording_propose(*args, **kwargs):
        tree = propose(*args, **kwargs)
        trees.append([tree])
        return tree

    def recording_choice(logits):
        trees[-1].append(logits.clone())
        return choice(logits)

    monkeypatch.setattr(cape_mod, "propose_tree", recording_propose)
    monkeypatch.setattr(cape_mod, "greedy_choice", recording_choice)
    r = spec_mod.speculative_generate(target, ModelDrafter(noisy, 200), PROMPT, max_new_tokens=24, k=3,
                                      sampling=greedy, eos_ids=[EOS], cape=CapeTable.parse("0.5:3,0.8:2,1:1"))
    plain = engine_mod.generate(target, [PROMPT], max_new_tokens=24, sampling=greedy, eos_ids=[EOS])[0]
    assert r.tokens == plain.tokens
    emitted = [plain.tokens[0]]
    assert sum(len(t.tokens) for t, _ in trees) > 4 * len(trees)  # alternatives were verified
    for tree, logits in trees:
        for node in range(len(tree.tokens)):
            path = cape_mod._path(tree, node)
            history = emitted + path
            want = _reference(target, PROMPT + history, history, greedy, greedy_logits=True)
            assert torch.equal(logits[node].isneginf(), want.isneginf()), (node, path)  # (min_new_tokens' EOS)
            finite = want.isfinite()
            assert float((logits[node][finite] - want[finite]).abs().max()) <= 1e-4, (node, path)
        emitted = _emitted_after(tree, logits, emitted)  # (the next round's history)


def _emitted_after(tree, logits, emitted):
    """The tokens emitted once `tree` is verified (its accepted path and the target's token after it)."""
    choice = logits.argmax(-1).tolist()
    node, out = 0, list(emitted)
    while True:
        children = [c for c in range(1, len(tree.tokens)) if tree.parents[c] == node and tree.tokens[c] == choice[node]]
        if not children:
            return out + [choice[node]]
        node = children[0]
        out.append(tree.tokens[node])


@pytest.mark.parametrize("off", [False, True])
def test_plain_decoding_draws_from_the_processed_distribution(off, monkeypatch):
    from dataclasses import replace

    target = _target()
    prompts = [PROMPT, _prompt(5, vocab=VOCAB, seed=8)]
    drawn = []
    draw = engine_mod.draw

    def recording_draw(processed, generators):
        drawn.append(processed.clone())
        return draw(processed, generators)

    monkeypatch.setattr(engine_mod, "draw", recording_draw)
    if off:  # the plain path's temperature 10% off
        wrong = replace(S, temperature=S.temperature * 1.1)
        monkeypatch.setattr(engine_mod, "process", lambda logits, s, state=None: process(logits, wrong, state))
    results = engine_mod.generate(target, prompts, max_new_tokens=12, sampling=S, eos_ids=[EOS])
    gaps = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # (the cache's rows: by length)
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        row = order.index(i)
        for t in range(len(r.tokens)):
            history = r.tokens[:t]
            state = Processors(S, [prompt], VOCAB, [EOS], "cpu")
            for tok in history:
                state.chosen(torch.tensor([tok]))
            with torch.inference_mode():
                logits = target(torch.tensor([prompt + history]))[:, -1].float()
            want = process(logits, S, state)[0].softmax(-1)
            gaps.append(float((drawn[t][row].softmax(-1) - want).abs().max()))
    assert len(gaps) >= 12
    assert (max(gaps) > 1e-3) if off else (max(gaps) <= TOL), max(gaps)


def test_the_reference_itself_divides_by_the_configured_temperature():
    """The reference above is sampling.py's own processing: its kept logits are step 1's (the penalties,
    min_new_tokens) divided by the temperature, by hand, so a temperature off inside sampling.py (which
    every path above would share) is seen too."""
    target = _target()
    generated = [3, 3, 8]
    state = Processors(S, [PROMPT], VOCAB, [EOS], "cpu")
    for t in generated:
        state.chosen(torch.tensor([t]))
    with torch.inference_mode():
        logits = target(torch.tensor([PROMPT + generated]))[:, -1].float()
    step1 = state(logits)[0]
    got = process(logits, S, state)[0]
    kept = got.isfinite()
    assert 1 < int(kept.sum()) < VOCAB  # (the filters cut some, not all)
    torch.testing.assert_close(got[kept], step1[kept] / S.temperature, rtol=0, atol=1e-6)
