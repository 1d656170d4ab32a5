"""Audit of generation sampling (generate/sampling.py, acceptance.py, speculative.py) against
independent references:
- the processed distribution (penalty, min_new_tokens, temperature, top-k, top-p, min-p) equals
  transformers' own processor list, built by its `_get_logits_processor` (its order), on the same
  logits, greedy and sampling, to 1e-6; the same comparison against the list with two warpers
  swapped (top-p before min-p, or the filters before temperature) finds a difference, so it can fail;
- speculative sampling at T = 0.8 with top-p, min-p, the penalties, min_new_tokens and an EOS keeps the
  target's processed distribution over the first three tokens of a generation (chi-square against
  the exact distribution enumerated from the target); resampling a rejection from p instead of the
  residual norm(max(0, p - q)) is rejected by the same check;
- in a sampled batch whose rows end at different times (an EOS, min_new_tokens), each row's tokens
  are what it gives alone; a speculative request's tokens do not depend on the requests run before it;
- generation_config.json keys that change transformers' tokens but that longctx does not apply
  (no_repeat_ngram_size, typical_p, min_new_tokens, ...) are said, not dropped silently."""

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

transformers = pytest.importorskip("transformers")

import test_hf  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.generate.acceptance import sampling_probs  # noqa: E402
from longctx.generate.drafters import ModelDrafter  # noqa: E402
from longctx.generate.engine import generate  # noqa: E402
from longctx.generate.sampling import Processors, Sampling, derive_seed, process  # noqa: E402
from longctx.generate.speculative import speculate_one, speculative_generate  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402

VOCAB = 50
EOS = [7, 9]


def _hf_model():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(cfg)


def _hf_processors(ref, prompt_len: int, s: Sampling):
    """transformers' processor list for `s` (its _get_logits_processor: its order)."""
    config = transformers.GenerationConfig(
        do_sample=not s.greedy, temperature=s.temperature if not s.greedy else None, top_k=s.top_k or None,
        top_p=s.top_p, min_p=s.min_p or None, repetition_penalty=s.repetition_penalty,
        min_new_tokens=s.min_new_tokens or None, eos_token_id=EOS)
    config._eos_token_tensor = torch.tensor(EOS)
    return ref._get_logits_processor(config, input_ids_seq_length=prompt_len, device="cpu")


def _settings():
    """(Sampling, logits [1, VOCAB], prompt, generated) over a grid of settings, on random logits of
    several scales (no exact ties: which of two tied tokens a cut keeps is arbitrary in both)."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for i in range(240):
        s = Sampling(temperature=[0.0, 0.3, 0.7, 1.0, 1.6][i % 5], top_k=[0, 1, 3, 10, 49][i % 7 % 5],
                     top_p=[1.0, 0.9, 0.5, 0.1][i % 11 % 4], min_p=[0.0, 0.05, 0.2][i % 13 % 3],
                     repetition_penalty=[1.0, 1.3, 0.7][i % 3], min_new_tokens=[0, 2, 5][i % 17 % 3])
        if s.greedy:
            s = Sampling(repetition_penalty=s.repetition_penalty, min_new_tokens=s.min_new_tokens)
        logits = torch.randn(1, VOCAB, generator=g) * [1.0, 4.0, 12.0][i % 19 % 3]
        prompt = torch.randint(0, VOCAB, (6,), generator=g).tolist()
        generated = torch.randint(0, VOCAB, (3,), generator=g).tolist()
        cases.append((s, logits, prompt, generated))
    return cases


def _ours(s, logits, prompt, generated):
    state = Processors(s, [prompt], VOCAB, EOS, "cpu")
    for t in generated:
        state.chosen(torch.tensor([t]))
    return process(logits, s, state)


def _mismatch(ours, theirs) -> bool:
    """Different kept sets, or distributions more than 1e-6 apart (greedy: a different argmax too)."""
    return not torch.equal(ours.isneginf(), theirs.isneginf()) or \
        (ours.softmax(-1) - theirs.softmax(-1)).abs().max() > 1e-6 or ours.argmax() != theirs.argmax()


def test_processed_distribution_is_transformers_in_its_order():
    ref = _hf_model()
    cases = _settings()
    assert sum(s.greedy for s, *_ in cases) >= 20 and sum(s.top_p < 1 and s.min_p > 0 for s, *_ in cases) >= 20
    swapped_top_p_min_p = swapped_temperature = 0
    for s, logits, prompt, generated in cases:
        ids = torch.tensor([prompt + generated])
        procs = _hf_processors(ref, len(prompt), s)
        theirs = procs(ids, logits.clone())
        ours = _ours(s, logits, prompt, generated)
        assert not _mismatch(ours, theirs), (s, ours, theirs)
        # the check can fail: the same processors in another order give another distribution
        names = [type(p).__name__ for p in procs]
        if "TopPLogitsWarper" in names and "MinPLogitsWarper" in names:
            order = list(procs)
            a, b = names.index("TopPLogitsWarper"), names.index("MinPLogitsWarper")
            order[a], order[b] = order[b], order[a]
            swapped_top_p_min_p += _mismatch(ours, transformers.LogitsProcessorList(order)(ids, logits.clone()))
        if "TemperatureLogitsWarper" in names and len(names) > names.index("TemperatureLogitsWarper") + 1:
            t = names.index("TemperatureLogitsWarper")
            order = [p for p in procs if p is not procs[t]] + [procs[t]]  # the filters on the raw logits
            swapped_temperature += _mismatch(ours, transformers.LogitsProcessorList(order)(ids, logits.clone()))
    print(f"other orders differ in {swapped_top_p_min_p} (top-p / min-p) and {swapped_temperature} (temperature last) "
          f"of {len(cases)} cases")
    assert swapped_top_p_min_p > 0 and swapped_temperature > 0


def processed_probs(target, s, prompt, vocab, eos, generated):
    """The target's exact next-token distribution after `generated`, processed as sampling `s` processes it."""
    state = Processors(s, [prompt], vocab, [eos], "cpu")
    for t in generated:
        state.chosen(torch.tensor([t]))
    with torch.inference_mode():
        return sampling_probs(target(torch.tensor([prompt + generated]))[:, -1], s, state)[0].double().numpy()


def _tiny(seed, vocab):
    overrides = ["--model.layers=1", f"--model.vocab_size={vocab}", "--model.dim=32", "--model.heads=2",
                 "--model.kv_heads=1", "--model.ffn_dim=64"]
    model = build_model(load_config(overrides=overrides).model, seed=seed).eval()
    with torch.no_grad():  # distributions of some conviction (a random model's are flat)
        model.lm_head_weight.mul_(6.0)
    return model


@pytest.mark.slow
def test_speculative_sampling_with_top_p_penalties_and_eos_keeps_the_targets_distribution(monkeypatch):
    """The first three tokens of 1,000 seeded generations (K = 2, vocabulary 6, token 5 the EOS with
    min_new_tokens 2: a third token may be the EOS) against the target's exact processed distribution,
    enumerated by plain forwards (chi-square p > 0.01, no impossible sequence drawn); a rule that
    resamples a rejection from p instead of the residual fails the same check (p < 1e-6 on 700 generations)."""
    import longctx.generate.speculative as sp

    vocab, eos, runs, prompt = 6, 5, 1000, [3, 1, 4]
    wrong_runs = 700
    target, draft = _tiny(1, vocab), _tiny(7, vocab)
    s = Sampling(temperature=0.8, top_p=0.8, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                 frequency_penalty=0.2, min_new_tokens=2)

    def probs(generated):
        return processed_probs(target, s, prompt, vocab, eos, generated)

    exact = np.zeros((vocab,) * 3)
    first = probs([])
    for a in np.flatnonzero(first):
        second = probs([int(a)])
        for b in np.flatnonzero(second):
            exact[a, b] = first[a] * second[b] * probs([int(a), int(b)])
    assert exact[eos].sum() == exact[:, eos].sum() == 0 and 0 < exact[:, :, eos].sum() < 1  # min_new_tokens 2
    exact = exact.flatten()

    def pvalue(runs):
        counts = np.zeros(vocab ** 3)
        for seed in range(runs):
            r = speculative_generate(target, ModelDrafter(draft, 16), prompt, max_new_tokens=3, k=2, sampling=s,
                                     eos_ids=[eos], seed=seed)
            tokens = r.tokens + [eos] * (r.finish_reason == "eos")
            assert len(tokens) == 3, (r.tokens, r.finish_reason)
            counts[np.ravel_multi_index(tokens, (vocab,) * 3)] += 1
        if counts[exact == 0].sum():
            return 0.0
        keep = exact * runs >= 5
        rare = ~keep & (exact > 0)
        observed, expected = counts[keep], exact[keep]
        if rare.any():
            observed, expected = np.append(observed, counts[rare].sum()), np.append(expected, exact[rare].sum())
        return chisquare(observed, expected / expected.sum() * observed.sum()).pvalue

    p_exact = pvalue(runs)

    def resample_from_p(proposals, q, p, sampling, generator):
        for i, d in enumerate(proposals):
            if float(torch.rand((), generator=generator)) >= min(1.0, float(p[i, d]) / max(float(q[i, d]), 1e-30)):
                return i, int(torch.multinomial(p[i], 1, generator=generator))
        return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))

    monkeypatch.setattr(sp, "accept", resample_from_p)
    # 700 generations for the wrong rule (p 2e-35 at 1,000): a false pass (p >= 1e-6) has probability
    # ~1e-5 (noncentral chi-square, lambda ~ 0.21 per generation on ~34 degrees of freedom)
    p_wrong = pvalue(wrong_runs)
    print(f"chi-square p: the rule {p_exact:.3g}, resampling from p {p_wrong:.3g}")
    assert p_exact > 0.01 and p_wrong < 1e-6


def test_rows_ending_at_different_times_sample_what_they_sample_alone():
    """T = 1 with every filter and penalty, min_new_tokens 3 and two EOS ids likely enough that rows
    end at different steps: each row of a batch of four prompts (and of num_samples) gives the tokens
    and finish reason it gives alone, and none ends before its third token."""
    model = _tiny(3, 12)
    s = Sampling(temperature=1.0, top_k=8, top_p=0.95, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3,
                 frequency_penalty=0.2, min_new_tokens=3)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [4, 3], [8, 9, 10, 11], [2]]
    seeds = [derive_seed(5, i) for i in range(4)]
    eos = [0, 1]
    batch = generate(model, prompts, max_new_tokens=24, sampling=s, eos_ids=eos, seeds=seeds)
    for prompt, seed, r in zip(prompts, seeds, batch):
        alone = generate(model, [prompt], max_new_tokens=24, sampling=s, eos_ids=eos, seeds=[seed])[0]
        assert (r.tokens, r.finish_reason) == (alone.tokens, alone.finish_reason)
        assert len(r.tokens) >= 3 and not set(r.tokens) & set(eos)
    lengths = {len(r.tokens) for r in batch}
    assert len(lengths) > 1 and any(r.finish_reason == "eos" for r in batch), [(len(r.tokens), r.finish_reason)
                                                                               for r in batch]
    samples = generate(model, prompts[:1], max_new_tokens=24, sampling=s, eos_ids=eos, seeds=[seeds[0]],
                       num_samples=3)
    assert samples[0].tokens == batch[0].tokens


def test_a_speculative_request_does_not_depend_on_the_requests_before_it():
    """`generate --draft` runs one request at a time, seeded by its index (derive_seed(run seed, i)):
    prompt 1's tokens at T = 1 (adaptive K) are the same run first or after prompt 0."""
    target, draft = _tiny(1, 40), _tiny(2, 40)
    s = Sampling(temperature=1.0, top_p=0.9, repetition_penalty=1.2)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 3, 4]]

    def one(i):
        return speculate_one(target, draft, prompts[i], 16, k=3, sampling=s, eos_ids=(), prefill_chunk=64,
                             seed=derive_seed(9, i), adaptive=True, draft_cost=0.2)

    alone = one(1)
    one(0)
    after = one(1)
    assert after.tokens == alone.tokens and after.accepted == alone.accepted


def test_generation_config_keys_longctx_does_not_apply_are_said(tmp_path):
    """A file setting no_repeat_ngram_size, typical_p and min_new_tokens (which transformers' generate
    follows) was read for its sampling keys alone, the others dropped without a word: now they are
    listed for the run's note (typical_p only when sampling; min_new_tokens unless the flag gives one),
    and keys at their neutral value are not."""
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    bpe_tokenizer(d / "tokenizer.json")
    (d / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "typical_p": 0.9, "no_repeat_ngram_size": 3, "min_new_tokens": 4,
         "num_beams": 1, "suppress_tokens": [], "bos_token_id": 1, "eos_token_id": 0}))

    def said(*argv):
        args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", "--prompt", "x",
                                                                *argv])
        prepare(args, rest)
        return args.generation_unapplied

    assert said() == "min_new_tokens 4, no_repeat_ngram_size 3, typical_p 0.9"
    assert said("--temperature", "0", "--min-new-tokens", "2") == "no_repeat_ngram_size 3"
    (d / "generation_config.json").write_text(json.dumps({"stop_strings": ["\n\n"]}))  # (transformers stops there)
    assert said() == 'stop_strings ["\\n\\n"]'
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "typical_p": 1.0, "num_beams": 1}))
    assert said() == ""
