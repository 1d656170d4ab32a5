"""Sampling per request and the generation features of issue 47 (generate/sampling.py, engine.py),
against transformers on random tiny checkpoints it wrote (fp32):
- per-request seeds: the same prompt and seed give the same 32 tokens at T = 1 alone, in a batch of 3
  of other lengths, and in batches of 1, 2 and 4; --num-samples' sample 0 is the prompt alone, sample s
  the prompt seeded sample_seed(seed, s);
- repetition penalty at T = 0 token-identical to transformers' generate(repetition_penalty=...), the
  logprobs within 1e-5 of log_softmax of its output_scores;
- min_new_tokens / ignore-eos as transformers' (EOS suppressed until the minimum);
- presence / frequency penalties: vLLM's formula, by hand;
- T > 0: temperature, top-k, top-p, min-p and the penalties together give the distribution of
  transformers' own processors (vLLM's presence / frequency formula inserted after its penalties;
  chi-square over the first two tokens of 4,000 samples; the same check rejects the sampler without
  the penalty), and each token's logprobs are log_softmax of those processors' scores for the
  sequence drawn (1e-5);
- the command's settings: generation_config.json defaults under the flags, bad values before work."""

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402
from test_generate import _debug_model, _prompt  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.errors import ConfigError  # noqa: E402
from longctx.generate.engine import generate  # noqa: E402
from longctx.generate.sampling import Processors, Sampling, derive_seed, sample_seed  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402

NEW = 32


def _hf(tmp_path, vocab=300, init=0.1):
    d, ref = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("llama", vocab_size=vocab, initializer_range=init))
    return load_hf(d), ref


def _hf_processors(ref, prompt_len: int, **settings):
    """transformers' own processor list (its order) for these generation settings."""
    config = transformers.GenerationConfig(**settings)
    config._eos_token_tensor = torch.tensor(settings["eos_token_id"]) if "eos_token_id" in settings else None
    return ref._get_logits_processor(config, input_ids_seq_length=prompt_len, device="cpu")


def test_a_request_draws_the_same_tokens_whatever_its_batch():
    """T = 1, 32 new tokens: prompt A seeded 77 alone, in a batch of three of other lengths (before and
    after it), and run seeds from one run seed over four prompts at --batch 1, 2 and 4."""
    model = _debug_model()
    vocab = model.cfg.vocab_size
    s = Sampling(temperature=1.0, seed=5)
    a = _prompt(12, vocab, 3)
    others = [_prompt(30, vocab, 4), _prompt(5, vocab, 6)]
    alone = generate(model, [a], max_new_tokens=NEW, sampling=s, seeds=[77])[0]
    assert len(alone.tokens) == NEW and alone.seed == 77
    for batch, at in (([others[0], a, others[1]], 1), ([a, *others], 0), ([*others, a], 2)):
        seeds = [1, 2, 3]
        seeds[at] = 77
        assert generate(model, batch, max_new_tokens=NEW, sampling=s, seeds=seeds)[at].tokens == alone.tokens
    # penalties and filters on: still the request's own
    pen = Sampling(temperature=1.0, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.5,
                   frequency_penalty=0.3)
    pen_alone = generate(model, [a], max_new_tokens=NEW, sampling=pen, seeds=[77])[0].tokens
    assert generate(model, [others[0], a, others[1]], max_new_tokens=NEW, sampling=pen,
                    seeds=[1, 77, 2])[1].tokens == pen_alone
    # the CLI's seeds (derive_seed(run seed, index in the file)) at batch sizes 1, 2 and 4
    prompts = [_prompt(n, vocab, 10 + n) for n in (9, 21, 4, 15)]
    seeds = [derive_seed(11, i) for i in range(4)]
    runs = {}
    for size in (1, 2, 4):
        runs[size] = [r.tokens for start in range(0, 4, size)
                      for r in generate(model, prompts[start:start + size], max_new_tokens=NEW, sampling=s,
                                        seeds=seeds[start:start + size])]
    assert runs[1] == runs[2] == runs[4]
    assert len({tuple(t) for t in runs[1]}) == 4
    # the default seeds are derive_seed(sampling.seed, index)
    assert [r.tokens for r in generate(model, prompts, max_new_tokens=NEW, sampling=Sampling(temperature=1.0,
                                                                                            seed=11))] == runs[4]


def test_num_samples_are_requests_of_their_own():
    model = _debug_model()
    vocab = model.cfg.vocab_size
    s = Sampling(temperature=1.0)
    a, b = _prompt(12, vocab, 3), _prompt(20, vocab, 8)
    results = generate(model, [a, b], max_new_tokens=16, sampling=s, seeds=[77, 9], num_samples=3)
    assert [(r.prompt_tokens, r.sample) for r in results] == [(12, 0), (12, 1), (12, 2), (20, 0), (20, 1), (20, 2)]
    for r, (prompt, seed) in zip(results, [(a, 77)] * 3 + [(b, 9)] * 3):
        alone = generate(model, [prompt], max_new_tokens=16, sampling=s, seeds=[sample_seed(seed, r.sample)])[0]
        assert r.tokens == alone.tokens and r.seed == sample_seed(seed, r.sample)
    assert len({tuple(r.tokens) for r in results[:3]}) == 3
    assert sample_seed(77, 0) == 77 and derive_seed(77, 1) != derive_seed(78, 1)


def test_repetition_penalty_greedy_and_logprobs_match_transformers(tmp_path):
    """T = 0: the tokens of transformers' generate(do_sample=False, repetition_penalty=1.5), and each
    position's logprobs (the chosen token's and the top 5) within 1e-5 of log_softmax of its scores
    (output_scores: the penalised logits)."""
    ours, ref = _hf(tmp_path)
    prompt = _prompt(40) + _prompt(10)  # repeats in the prompt too
    ref.generation_config.eos_token_id = None
    worst = 0.0
    for penalty in (1.5, 0.8):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=NEW, do_sample=False, repetition_penalty=penalty,
                               pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        theirs = out.sequences[0, len(prompt):].tolist()
        got = generate(ours, [prompt], max_new_tokens=NEW, sampling=Sampling(repetition_penalty=penalty),
                       logprobs=5)[0]
        plain = generate(ours, [prompt], max_new_tokens=NEW)[0].tokens
        assert got.tokens == theirs and got.tokens != plain
        lp = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1)
        top = lp.topk(5, -1)
        for t, token in enumerate(got.tokens):
            worst = max(worst, abs(got.logprobs[t] - lp[t, token].item()))
            assert [i for i, _ in got.top_logprobs[t]] == top.indices[t].tolist()
            worst = max(worst, max(abs(v - w) for (_, v), w in zip(got.top_logprobs[t], top.values[t].tolist())))
    print(f"max |logprob - transformers| at T = 0: {worst:.2e}")
    assert worst <= 1e-5, worst


def test_min_new_tokens_and_ignore_eos_follow_transformers(tmp_path):
    ours, ref = _hf(tmp_path)
    prompt = _prompt(30)
    free = generate(ours, [prompt], max_new_tokens=NEW)[0].tokens
    eos = free[2]
    for minimum in (0, 6, 20):
        with torch.no_grad():
            seq = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=NEW, do_sample=False, min_new_tokens=minimum,
                               eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
        theirs = seq[:seq.index(eos)] if eos in seq else seq
        got = generate(ours, [prompt], max_new_tokens=NEW, sampling=Sampling(min_new_tokens=minimum), eos_ids=[eos])[0]
        assert got.tokens == theirs, minimum
        assert got.finish_reason == ("eos" if len(got.tokens) < NEW else "length")
        assert len(got.tokens) >= minimum
    # --ignore-eos is eos_ids=(): EOS kept as a token and the run goes on
    assert generate(ours, [prompt], max_new_tokens=NEW, eos_ids=())[0].tokens == free


def test_presence_and_frequency_penalties_are_vllms():
    """logit -= frequency x count + presence x (count > 0), counting the generated tokens only, after
    the repetition penalty (transformers' RepetitionPenaltyLogitsProcessor over prompt and generated)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 10, generator=g)
    prompts, generated = [[1, 2], [3]], [[2, 5, 5], [7, 7, 7]]
    s = Sampling(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25)
    proc = Processors(s, prompts, 10, [], "cpu")
    for step in range(3):
        proc.chosen(torch.tensor([generated[0][step], generated[1][step]]))
    got = proc(logits)
    for r in range(2):
        history = torch.tensor([prompts[r] + generated[r]])
        want = RepetitionPenaltyLogitsProcessor(1.3)(history, logits[r:r + 1].clone())[0]
        counts = torch.bincount(torch.tensor(generated[r]), minlength=10).float()
        want = want - 0.5 * (counts > 0) - (-0.25) * counts
        torch.testing.assert_close(got[r], want)
    x = logits[0, 1]
    assert got[0, 1] == (x / 1.3 if x > 0 else x * 1.3)  # token 1 in the prompt only: no presence penalty


def _two_token_draws(ours, prompt, sampling, samples):
    """The first two new tokens of `samples` requests (one batch: num_samples)."""
    results = generate(ours, [prompt], max_new_tokens=2, sampling=sampling, seeds=[123], num_samples=samples,
                       logprobs=0)
    return [tuple(r.tokens) for r in results]


class _VllmPenalties:
    """vLLM's presence / frequency penalties as a transformers logits processor (over the generated tokens)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


CASES = {  # (settings, the same without one of them: a sampler the check must reject)
    "repetition": (dict(temperature=0.8, top_k=10, top_p=0.95, min_p=0.05, repetition_penalty=1.5),
                   dict(temperature=0.8, top_k=10, top_p=0.95, min_p=0.05)),
    "presence-frequency": (dict(temperature=1.2, min_p=0.02, presence_penalty=0.8, frequency_penalty=0.5),
                           dict(temperature=1.2, min_p=0.02)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_with_processors_is_transformers_distribution(tmp_path, case):
    """On a 16-token vocabulary, the first two tokens of 4,000 requests against the exact distribution of
    transformers' processors (chi-square p > 0.01): temperature 0.8, top-k 10, top-p 0.95, min-p 0.05,
    repetition penalty 1.5; or temperature 0.8, min-p 0.05 and vLLM's presence 0.8 / frequency 0.5 (a
    processor of that formula inserted after transformers' penalties). Without the penalty the same check
    fails (p < 0.01)."""
    ours, ref = _hf(tmp_path, vocab=16, init=0.2)
    prompt, vocab, runs = [3, 1, 4, 1, 5, 9, 2, 6], 16, 4000
    good, bad = CASES[case]
    hf = {k: v for k, v in good.items() if k not in ("presence_penalty", "frequency_penalty")}
    procs = _hf_processors(ref, len(prompt), do_sample=True, **hf)
    if "presence_penalty" in good:
        at = next(i for i, p in enumerate(procs) if isinstance(p, transformers.TemperatureLogitsWarper))
        procs.insert(at, _VllmPenalties(len(prompt), good["presence_penalty"], good["frequency_penalty"]))

    def probs(ids):
        with torch.no_grad():
            scores = ref(torch.tensor([ids])).logits[:, -1].float()
        return procs(torch.tensor([ids]), scores).softmax(-1)[0].double()

    p1 = probs(prompt)
    exact = torch.stack([p1[a] * probs(prompt + [a]) for a in range(vocab)]).flatten().numpy()
    keep = exact * runs >= 5  # chi-square on the cells expected at least 5 times, the other possible ones pooled
    rare = ~keep & (exact > 0)

    def pvalue(sampling):
        counts = np.zeros(vocab * vocab)
        for a, b in _two_token_draws(ours, prompt, sampling, runs):
            counts[a * vocab + b] += 1
        if counts[exact == 0].sum():  # a pair the processors remove: not their distribution
            return 0.0
        observed = np.append(counts[keep], counts[rare].sum()) if rare.any() else counts[keep]
        expected = np.append(exact[keep], exact[rare].sum()) if rare.any() else exact[keep]
        return chisquare(observed, expected / expected.sum() * observed.sum()).pvalue

    p_good, p_bad = pvalue(Sampling(**good)), pvalue(Sampling(**bad))
    print(f"{case}: chi-square p: processors {p_good:.3g}, without the penalty {p_bad:.3g}")
    assert p_good > 0.01 and p_bad < 0.01


def test_sampled_logprobs_are_transformers_processed_scores(tmp_path):
    """T > 0 with every processor: each new token's logprobs (chosen and top 5) equal log_softmax of the
    scores transformers' own processor list gives for the sequence drawn (1e-5), tokens the filters
    removed left out of the top list."""
    ours, ref = _hf(tmp_path)
    prompt = _prompt(40)
    settings = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                    min_new_tokens=4, eos_token_id=[5, 6])
    procs = _hf_processors(ref, len(prompt), **settings)
    sampling = Sampling(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3, min_new_tokens=4)
    got = generate(ours, [prompt], max_new_tokens=NEW, sampling=sampling, eos_ids=[5, 6], logprobs=5, seeds=[4])[0]
    ids = torch.tensor([prompt + got.tokens])
    with torch.no_grad():
        logits = ref(ids).logits[0].float()
    worst = 0.0
    for t, token in enumerate(got.tokens):
        at = len(prompt) + t - 1
        lp = torch.log_softmax(procs(ids[:, :at + 1], logits[at:at + 1].clone()), -1)[0]
        worst = max(worst, abs(got.logprobs[t] - lp[token].item()))
        top = lp.topk(5)
        want = [(i, v) for i, v in zip(top.indices.tolist(), top.values.tolist()) if v != float("-inf")]
        assert [i for i, _ in got.top_logprobs[t]] == [i for i, _ in want]
        worst = max([worst] + [abs(a[1] - b[1]) for a, b in zip(got.top_logprobs[t], want)])
    print(f"max |logprob - transformers| {worst:.2e}")
    assert worst <= 1e-5


# ------------------------------------------------------------------------------------------------
# the command's settings: generation_config.json defaults under the flags, and bad input before work


@pytest.fixture
def weightless_hf(tmp_path):
    """An hf:DIR with a config and a tokenizer, no weights: what is checked before work."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    bpe_tokenizer(d / "tokenizer.json")
    return d


def _prepare(d, *argv):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", *argv])
    return prepare(args, rest), args


def test_a_sampling_temperature_of_0_in_generation_config_is_said_to_decode_greedily(weightless_hf):
    """do_sample true with temperature 0: transformers' generate raises; longctx decodes greedily and says so."""
    (weightless_hf / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0}))
    request, args = _prepare(weightless_hf, "--prompt", "x")
    assert request.sampling.greedy
    assert args.generation_defaults == "do_sample true, temperature 0 (greedy: transformers' generate refuses to " \
        "sample at temperature 0)"


def test_generation_config_gives_the_defaults_and_flags_override(weightless_hf):
    (weightless_hf / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.1,
         "max_new_tokens": 40, "eos_token_id": 0, "bos_token_id": 1}))
    request, args = _prepare(weightless_hf, "--prompt", "x")
    s = request.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (0.6, 0, 0.9, 0.1, 1.1)
    assert request.limits == [40] and args.generation_defaults == \
        "do_sample true, temperature 0.6, top_p 0.9, min_p 0.1, repetition_penalty 1.1, max_new_tokens 40"
    request, args = _prepare(weightless_hf, "--prompt", "x", "--temperature", "0", "--top-p", "1",
                             "--max-new-tokens", "7")
    assert request.sampling.greedy and request.sampling.top_p == 1.0 and request.limits == [7]
    assert args.generation_defaults == "repetition_penalty 1.1"  # (greedy: the file's filters do not apply)
    # do_sample false: greedy whatever its temperature (transformers' rule); the penalty still applies
    (weightless_hf / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.2}))
    request, args = _prepare(weightless_hf, "--prompt", "x")
    assert request.sampling.greedy and request.sampling.repetition_penalty == 1.2 and args.max_new_tokens == 256
    assert args.generation_defaults == "do_sample false (greedy), repetition_penalty 1.2"
    # sampling asked by the flag: the file's filters apply, as to transformers' do_sample=True
    (weightless_hf / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 20}))
    request, args = _prepare(weightless_hf, "--prompt", "x", "--temperature", "0.7")
    assert (request.sampling.temperature, request.sampling.top_k) == (0.7, 20)
    assert args.generation_defaults == "top_k 20"
    (weightless_hf / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 2.0}))
    with pytest.raises(ConfigError, match=r"--top-p must be in \(0, 1\].*from generation_config.json: do_sample "
                                          r"true, temperature 1.0, top_p 2.0"):
        _prepare(weightless_hf, "--prompt", "x")


@pytest.mark.parametrize("argv, message", [
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--repetition-penalty", "-1.2"], "--repetition-penalty must be > 0"),
    (["--presence-penalty", "2.5"], "--presence-penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty must be in [-2, 2]"),
    (["--min-p", "1.5"], "--min-p must be in [0, 1]"),
    (["--min-p", "-0.1"], "--min-p must be in [0, 1]"),
    (["--num-samples", "0"], "--num-samples must be >= 1"),
    (["--num-samples", "3"], "--num-samples 3 with greedy decoding would write 3 copies"),
    (["--min-new-tokens", "-1"], "--min-new-tokens must be >= 0"),
    (["--min-new-tokens", "20", "--max-new-tokens", "10"], "--min-new-tokens 20 is more than --max-new-tokens 10"),
    (["--logprobs", "-1"], "--logprobs must be >= 0"),
])
def test_bad_settings_are_one_clear_error_before_work(weightless_hf, argv, message):
    with pytest.raises(ConfigError) as e:
        _prepare(weightless_hf, "--prompt", "x", *argv)
    assert message in str(e.value)


def test_a_max_new_tokens_below_one_is_said_once(weightless_hf):
    """Not also as "--min-new-tokens 0 is more than --max-new-tokens -3": one fault, one line."""
    with pytest.raises(ConfigError) as e:
        _prepare(weightless_hf, "--prompt", "x", "--max-new-tokens", "-3")
    assert "--max-new-tokens must be >= 1, got -3" in str(e.value) and "is more than" not in str(e.value)


def test_a_prompt_seed_must_be_an_integer(weightless_hf, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "seed": 5}\n{"prompt": "b"}\n')
    request, _ = _prepare(weightless_hf, "--prompts", str(f))
    assert [p.get("seed") for p in request.prompts] == [5, None]
    for bad in ('"5"', "1.5", "true", "null"):
        f.write_text(f'{{"prompt": "a"}}\n{{"prompt": "b", "seed": {bad}}}\n')
        with pytest.raises(ConfigError, match='line 2: "seed" must be an integer'):
            _prepare(weightless_hf, "--prompts", str(f))


@pytest.mark.parametrize("argv", [["--top-k", "5"], ["--top-p", "0.9", "--min-p", "0.1"]])
def test_filters_with_greedy_decoding_are_said_not_dropped(weightless_hf, argv):
    with pytest.raises(ConfigError, match="decoding is greedy .temperature 0., where .* nothing: add --temperature"):
        _prepare(weightless_hf, "--prompt", "x", *argv)
    assert _prepare(weightless_hf, "--prompt", "x", "--temperature", "0.7", *argv)[0].sampling.temperature == 0.7
