"""Adaptive speculation length (generate/spec_length.py, --speculate-adaptive):
- the policy alone: the first round proposes the cap; a draft whose proposals are all kept keeps K at
  the cap, one whose proposals are all rejected brings it to 0, plain steps, with a probe round after
  every 16 (and back up when it recovers); K is never above the cap; the choice after a history is
  the one worked out by hand from E(K) / (K (c + w) + 1), and the same history always gives the same
  choices;
- generation: at T = 0, chain and CaPE, plain greedy decoding's tokens, token for token, while K
  varies; at T = 1 a seed gives the same tokens and choices twice (another seed others);
- plain steps (K = 0, where no K pays: a draft dearer than the target, or --verify-cost): the drafter
  stays in step (a draft equal to the target keeps every proposal; a GliDe draft's cache gets each
  pending token), the tokens are plain greedy's, and a seed still gives the same tokens;
- bad input (adaptive without a draft, a cap below 1, --draft-cost or --verify-cost without adaptive,
  or out of range) is one ConfigError from `longctx generate` before any file or weight is read.
The sampled distribution with adaptive K: tests/unit/test_speculative.py's chi-square (T1-adaptive)."""

import random

import pytest
import torch

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.generate.cape import CapeTable
from longctx.generate.cli import prepare
from longctx.generate.drafters import ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.generate.spec_length import AdaptiveLength, best_length, draft_cost_ratio
from longctx.generate.speculative import speculate_one, speculative_generate
from longctx.models.llama import build_model


def _replay(policy: AdaptiveLength, history) -> list[int]:
    """The K the policy gives over rounds whose kept count is history[i](k): its choices."""
    for keep in history:
        k = policy.next()
        policy.observe(min(keep(k), k), k)
    return policy.chosen


def test_the_first_round_proposes_the_cap_and_acceptance_moves_k_within_0_to_the_cap():
    every = _replay(AdaptiveLength(6, 0.1), [lambda k: k] * 10)  # every proposal kept
    assert every == [6] * 10
    # every first proposal rejected: no K pays, so plain steps (K = 0), with a probe of K = 1 after 16 of
    # them, then after 32 (each probe rejected too: the wait doubles)
    none = _replay(AdaptiveLength(6, 0.1), [lambda k: 0] * 60)
    assert none == [6] + [0] * 16 + [1] + [0] * 32 + [1] + [0] * 9
    # a stretch the draft misses, then follows: plain steps, and back up to the cap through the probes
    policy = AdaptiveLength(6, 0.1, probe_every=1)
    down_up = _replay(policy, [lambda k: 0] * 6 + [lambda k: k] * 14)
    assert 0 in down_up[:6] and down_up[-1] == 6
    rises = [k for k in down_up[6:] if k]
    assert rises == sorted(rises)
    rng = random.Random(0)
    for cap in (1, 2, 5):
        for c in (0.01, 0.3, 2.0):
            chosen = _replay(AdaptiveLength(cap, c), [lambda k: rng.randint(0, k) for _ in range(60)])
            assert chosen[0] == cap and all(0 <= k <= cap for k in chosen)
    assert _replay(AdaptiveLength(5, 2.0), [lambda k: k] * 3)[1:] == [0, 0]  # a draft dearer than the target


def test_a_plain_round_tells_nothing_and_probes_back_off_until_one_keeps():
    policy = AdaptiveLength(4, 0.1, probe_every=3)
    policy.observe(0, 4)  # (a rejected first proposal: alpha 0)
    before = (policy.successes, policy.trials)
    policy.observe(0, 0)  # a plain round: the moving averages do not move
    assert (policy.successes, policy.trials) == before
    rounds = []
    while len([k for k in rounds if k]) < 3:  # the first two probes keep nothing, the third keeps one
        k = policy.next()
        rounds.append(k)
        policy.observe(int(k > 0 and len([j for j in rounds if j]) == 3), k)
    # probes after 3, then 6 (doubled), then 12 plain rounds; the third kept: the wait is back to 3 and
    # alpha high enough that the next round proposes without a probe
    assert [i for i, k in enumerate(rounds) if k] == [3, 10, 23]
    assert policy.wait == 3 and policy.next() >= 1


def test_the_choice_is_the_hand_worked_optimum_and_depends_on_the_history_alone():
    # after one round keeping 1 of 4, alpha = 1 / (1 + 1) (the rejected 2nd proposal is the only failure
    # tested; the 3rd and 4th were never verified). With c = 0.1: tokens / cost = 1.5 / 1.1 = 1.364 at
    # K = 1, 1.75 / 1.2 = 1.458 at K = 2, 1.875 / 1.3 = 1.442 at K = 3: K = 2.
    policy = AdaptiveLength(4, 0.1)
    assert policy.next() == 4
    policy.observe(1, 4)
    assert policy.alpha == pytest.approx(0.5) and policy.next() == 2
    # alpha 0.8, c 0.05: 1.8/1.05 = 1.714, 2.44/1.1 = 2.218, 2.952/1.15 = 2.567, 3.362/1.2 = 2.801,
    # 3.689/1.25 = 2.952, 3.951/1.3 = 3.040, 4.161/1.35 = 3.082, 4.329/1.4 = 3.092, 4.463/1.45 = 3.078: K = 8
    assert best_length(0.8, 0.05, 12) == 8 and best_length(0.8, 0.05, 5) == 5
    # alpha 0: E(K) = 1 for K x c + 1 passes, below a plain step's 1 per pass; the best K >= 1 is 1
    assert best_length(0.0, 0.05, 12) == 0 and best_length(0.0, 0.05, 12, plain=False) == 1
    assert best_length(1.0, 0.05, 12) == 12
    assert best_length(1.0, 1.0, 12) == 0  # a draft as dear as the target: every K ties a plain step, the least wins
    # the verification's cost per extra token w: alpha 0.5, c 0.1. w 0: K = 2 (above). w 0.3: 1.5 / 1.4 = 1.071
    # at K = 1, 1.75 / 1.8 = 0.972 at K = 2: K = 1. w 0.5: 1.5 / 1.6 = 0.9375 < 1 at K = 1: a plain step
    assert [best_length(0.5, 0.1, 4, w) for w in (0.0, 0.3, 0.5)] == [2, 1, 0]
    rng = random.Random(3)
    kept = [rng.randint(0, 4) for _ in range(40)]
    runs = [_replay(AdaptiveLength(4, 0.2), [lambda k, n=n: n for n in kept]) for _ in range(2)]
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
    assert _replay(AdaptiveLength(4, 0.2), [lambda k, n=n: 4 - n for n in kept]) != runs[0]


def test_the_default_draft_cost_is_the_flops_ratio():
    target, draft = _model(1, layers=4), _model(2, layers=1)
    # per token, 2 x matmul weights: a layer of dim 128 (q 128x128, k and v 128x64, o 128x128, ffn 3 x 128x384)
    # and the LM head (128 x 320)
    layer, head = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 384, 128 * 320
    assert draft_cost_ratio(target, draft) == pytest.approx((layer + head) / (4 * layer + head))


def _model(seed, layers=2):
    return build_model(load_config(overrides=[f"--model.layers={layers}"]).model, seed=seed).eval()


def _noisy(target, scale=0.8):
    """The target with a noisy LM head: it follows the target on some stretches and not on others."""
    draft = _model(1, layers=len(target.layers))
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        w = draft.lm_head_weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std() * scale)
    return draft


def _prompt(n, seed):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("cape", [None, "0.5:2,1:0"])
def test_greedy_with_adaptive_k_is_plain_greedy_token_for_token(cape):
    target = _model(1)
    draft = _noisy(target)
    table = CapeTable.parse(cape) if cape else None
    for n in (1, 40):
        prompt = _prompt(n, seed=n + 2)
        plain = generate(target, [prompt], max_new_tokens=48)[0].tokens
        policy = AdaptiveLength(5, 0.05)
        spec = speculative_generate(target, ModelDrafter(draft, n + 60), prompt, max_new_tokens=48, k=5, cape=table,
                                    adaptive=policy)
        assert spec.tokens == plain
        assert len(policy.chosen) == spec.passes and len(set(policy.chosen)) > 1, policy.chosen  # K did vary
        assert all(p <= k for p, k in zip(spec.proposed, policy.chosen))  # each round made at most its K
        # the same through adaptive=True with a given cost (and the same choices: one history)
        again = speculative_generate(target, ModelDrafter(draft, n + 60), prompt, max_new_tokens=48, k=5,
                                     cape=table, adaptive=True, draft_cost=0.05)
        assert again.tokens == plain and again.proposed == spec.proposed


def test_seeded_sampling_with_adaptive_k_is_reproducible():
    target = _model(1)
    with torch.no_grad():  # distributions of some conviction (a random model's are flat: every proposal kept)
        target.lm_head_weight.mul_(6.0)
    draft = _noisy(target, scale=2.0)
    prompt, s = _prompt(20, seed=3), Sampling(temperature=1.0)
    runs = [speculate_one(target, draft, prompt, 40, k=4, sampling=s, eos_ids=(), prefill_chunk=64, seed=seed,
                          adaptive=True, draft_cost=0.05) for seed in (77, 77, 78)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    assert runs[0].proposed == runs[1].proposed and len(set(runs[0].proposed)) > 1  # the same K each round


def _prepare(*argv):
    args, rest = build_parser("generate").parse_known_args(["generate", *argv])
    return prepare(args, rest)


@pytest.mark.parametrize("flags, message", [
    (["--speculate-adaptive"], "--speculate-adaptive chooses how many tokens a draft proposes.*--draft DIR"),
    (["--draft", "no/draft", "--speculate-adaptive", "--speculate", "0"], "must be >= 1, got 0"),
    (["--draft", "no/draft", "--draft-cost", "0.1"], "add --speculate-adaptive"),
    (["--draft", "no/draft", "--speculate-adaptive", "--draft-cost", "0"], "--draft-cost must be a ratio > 0"),
    (["--draft", "no/draft", "--speculate-adaptive", "--draft-cost", "nan"], "--draft-cost must be a ratio > 0"),
    (["--draft", "no/draft", "--verify-cost", "0.2"], "add --speculate-adaptive, or drop --verify-cost"),
    (["--draft", "no/draft", "--speculate-adaptive", "--verify-cost", "-1"], "--verify-cost must be >= 0"),
])
def test_bad_adaptive_flags_are_one_error_before_any_work(flags, message):
    # (the checkpoint, prompts file and draft do not exist: the error comes before anything is read)
    with pytest.raises(ConfigError, match=message):
        _prepare("--checkpoint", "no/such/checkpoint", "--prompts", "no/such.jsonl", *flags)
    with pytest.raises(ValueError, match="cap"):
        AdaptiveLength(0, 0.1)


class Scripted(AdaptiveLength):
    """A policy whose K follow `schedule`, cycled (plain steps, K = 0, where it says 0)."""

    def __init__(self, cap: int, schedule: list[int]):
        super().__init__(cap, 0.1)
        self.schedule = schedule

    def next(self) -> int:
        k = self.schedule[len(self.chosen) % len(self.schedule)]
        self.chosen.append(k)
        return k


SCHEDULE = [3, 0, 0, 2, 0, 4, 1, 0]


@pytest.mark.parametrize("cape", [None, "0.5:2,1:0"])
def test_plain_steps_keep_a_draft_in_step_with_the_target(cape):
    # a draft that is the target proposes the target's own tokens exactly when its cache holds every
    # token the target's does: after plain steps (which the draft does not run) too
    target = _model(1)
    twin = _model(2)
    twin.load_state_dict(target.state_dict())
    table = CapeTable.parse(cape) if cape else None
    for n in (1, 30):
        prompt = _prompt(n, seed=n + 5)
        plain = generate(target, [prompt], max_new_tokens=40)[0].tokens
        policy = Scripted(4, SCHEDULE)
        spec = speculative_generate(target, ModelDrafter(twin, n + 50), prompt, max_new_tokens=40, k=4, cape=table,
                                    adaptive=policy)
        assert spec.tokens == plain
        assert 0 in policy.chosen[:spec.passes] and sum(spec.proposed) > 0
        assert sum(spec.accepted) == sum(spec.proposed)  # every proposal kept: the draft never fell behind
    # sampled (T = 1): a draft equal to the target is kept with probability 1, and a seed gives its tokens
    soft = Sampling(temperature=1.0)
    runs = [speculative_generate(target, ModelDrafter(twin, 80), _prompt(20, 1), max_new_tokens=30, k=4,
                                 sampling=soft, seed=5, adaptive=Scripted(4, SCHEDULE)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and sum(runs[0].accepted) == sum(runs[0].proposed) > 0


def test_plain_steps_with_a_glide_draft_are_plain_greedy_and_feed_its_cache():
    from longctx.generate.drafters import GlideDrafter
    from longctx.models.glide import GlideDraft

    class Checked(GlideDrafter):  # each round's pending token lands in the draft's cache right after the target's
        def propose(self, pending, k, *a, **kw):
            out = super().propose(pending, k, *a, **kw)
            assert self.offset + self._base == int(self.target_cache.lengths[0]) + 1
            self.rounds = getattr(self, "rounds", 0) + 1
            return out

    target = _model(1)
    draft = GlideDraft(target.cfg, layers=1).init_weights(seed=4, std=0.05)
    for n, window in ((1, 0), (40, 0), (40, 8)):
        prompt = _prompt(n, seed=n)
        plain = generate(target, [prompt], max_new_tokens=30)[0].tokens
        for cape in (None, CapeTable.parse("0.5:2,1:0")):
            drafter = Checked(draft, target, n + 30 + 8, block=4, window=window)
            spec = speculative_generate(target, drafter, prompt, max_new_tokens=30, k=4, cape=cape,
                                        adaptive=Scripted(4, SCHEDULE))
            assert spec.tokens == plain and drafter.rounds > 2, (n, window, cape)


def test_a_high_verification_cost_turns_rounds_into_plain_steps_with_the_same_tokens():
    target = _model(1)
    draft = _noisy(target, scale=0.3)
    prompt = _prompt(30, seed=4)
    plain = generate(target, [prompt], max_new_tokens=48)[0].tokens
    cheap, dear = AdaptiveLength(4, 0.05), AdaptiveLength(4, 0.05, verify_cost=2.0)
    runs = [speculative_generate(target, ModelDrafter(draft, 90), prompt, max_new_tokens=48, k=4, adaptive=policy)
            for policy in (cheap, dear)]
    assert runs[0].tokens == runs[1].tokens == plain
    assert dear.chosen.count(0) > cheap.chosen.count(0) and dear.chosen.count(0) > len(dear.chosen) // 2
    # (through the flag's path too)
    again = speculative_generate(target, ModelDrafter(draft, 90), prompt, max_new_tokens=48, k=4, adaptive=True,
                                 draft_cost=0.05, verify_cost=2.0)
    assert again.tokens == plain and again.proposed == runs[1].proposed


def test_a_trees_extra_nodes_are_in_the_verifications_cost():
    # alpha 0.5 (one round keeping 1 of 4), c 0.1, w 0.2. A chain (width 1) costs K x 0.3 + 1: 1.5 / 1.3 =
    # 1.154 at K = 1, 1.75 / 1.6 = 1.094 at K = 2: K = 1. A tree that verified 12 nodes for 4 proposals
    # (3 per proposal) moves width to 0.7 x 1 + 0.3 x 3 = 1.6: K x (0.1 + 0.2 x 1.6) + 1: 1.5 / 1.42 = 1.056
    # at K = 1: K = 1; after three such rounds width 1 + 2 x (1 - 0.7^3) = 2.314: 1.5 / 1.563 = 0.96 < 1,
    # below a plain step's 1 token per pass: K = 0
    chain, tree = AdaptiveLength(4, 0.1, verify_cost=0.2), AdaptiveLength(4, 0.1, verify_cost=0.2)
    for policy, verified in ((chain, None), (tree, 12)):
        policy.next()
        policy.observe(1, 4, verified)
    assert chain.alpha == tree.alpha == pytest.approx(0.5)
    assert tree.width == pytest.approx(0.7 * 1 + 0.3 * 3) and chain.width == 1.0
    assert chain.next() == 1 and tree.next() == 1
    for _ in range(2):
        tree.observe(1, 4, 12)
    assert tree.width == pytest.approx(1 + 2 * (1 - 0.7 ** 3)) and tree.next() == 0
    # with w = 0 (a GPU's verification) the extra nodes cost nothing: the chain's choice
    free = AdaptiveLength(4, 0.1)
    free.next()
    free.observe(1, 4, 12)
    assert free.next() == best_length(0.5, 0.1, 4) == 2
    with pytest.raises(ValueError, match="verifies at least its 4 proposals"):
        free.observe(1, 4, 3)


def test_cape_rounds_report_their_trees_nodes_to_the_policy():
    target = _model(1)
    draft = _noisy(target)
    prompt = _prompt(30, seed=5)
    table = CapeTable.parse("0.99:2,1:0")  # two alternatives per depth unless the draft is all but sure
    plain = generate(target, [prompt], max_new_tokens=32)[0].tokens
    policy = AdaptiveLength(4, 0.05)
    spec = speculative_generate(target, ModelDrafter(draft, 90), prompt, max_new_tokens=32, k=4, cape=table,
                                adaptive=policy)
    assert spec.tokens == plain and policy.width > 2.0, policy.width  # about 3 nodes per proposal
