"""What `generate` reports and when it stops (generate/loop.py, results.py, output.py, speculative.py),
against independent references:
- a batch of prompts of different lengths, two EOS ids, min_new_tokens and a repetition penalty at
  T = 0: each row's tokens, finish reason and logprobs (chosen and top 3) are those of transformers'
  batched, left-padded generate (compute_transition_scores of its output_scores: the processed
  distribution, as docs/generate.md says, not output_logits); a row's tokens after its EOS are not
  reported;
- sampled (T = 0.7, top-k, min_new_tokens, two EOS ids) in a batch with two samples per prompt: each
  row's logprobs are transformers' processor list on a full forward of that row's sequence;
- speculation ends at exactly max_new_tokens (limits below, at and above a round's K + 1), the tokens
  and logprobs plain decoding's; a stop string completed inside an accepted block ends the rounds and
  cuts the tokens, logprobs and text where plain decoding does (the rounds ran on to the limit, and the
  decode rate counted the kept tokens over all the rounds' time: 9 tokens over 39 tokens' seconds);
- a byte-fallback tokenizer (Llama's, Mistral's tokenizer.json decoder), which decodes a run of byte
  tokens that is not valid UTF-8 as U+FFFD per byte: a stop string at the end of a long run is seen
  (after five 4-byte characters it was missed: the tail read began inside a character, and the whole
  run decoded to U+FFFD), the streamed text equals the JSON text (it showed U+FFFD for characters in
  6 of 400 random scripts), and --echo's continuation is the whole decoding less the prompt's (it was
  U+FFFD after a prompt whose last 8 tokens began inside a character)."""

import contextlib
import io
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
import test_hf  # noqa: E402
from test_speculative import _model  # noqa: E402

import longctx.progress  # noqa: E402
from longctx.generate.engine import generate  # noqa: E402
from longctx.generate.output import Output, StopStrings, continuation_text  # noqa: E402
from longctx.generate.results import Result  # noqa: E402
from longctx.generate.sampling import Sampling  # noqa: E402
from longctx.generate.speculative import speculate_one  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)
PAD = 7  # in every prompt below: transformers' repetition penalty also reads the left padding


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d, ref = test_hf.random_hf_dir(tmp_path_factory.mktemp("outaud"),
                                   test_hf.hf_config("llama", vocab_size=300, initializer_range=0.1))
    return load_hf(d), ref


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [[PAD, *torch.randint(8, 300, (n,), generator=g).tolist()] for n in (8, 22, 3)]


def test_a_batch_with_eos_ids_reports_what_transformers_left_padded_batch_does(hf):
    ours, ref = hf
    prompts, new = _prompts(), 16
    free = [r.tokens for r in generate(ours, prompts, max_new_tokens=new)]
    # row 0's third free token (with the penalty it comes second: min_new_tokens 4 holds it off, row 0 then
    # runs to the limit), row 2's sixth (row 2 ends on it, its fifth)
    eos = [free[0][2], free[2][5]]
    settings = dict(repetition_penalty=1.3, min_new_tokens=4)
    got = generate(ours, prompts, max_new_tokens=new, sampling=Sampling(**settings), eos_ids=eos, logprobs=3)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD,
                           eos_token_id=eos, output_scores=True, output_logits=True, return_dict_in_generate=True,
                           **settings)
    chosen = ref.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    raw = ref.compute_transition_scores(out.sequences, out.logits, normalize_logits=True)
    scores = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)  # [rows, steps, vocab]
    reasons, worst = [], 0.0
    for i, r in enumerate(got):
        theirs = out.sequences[i, width:].tolist()
        end = next((j for j, t in enumerate(theirs) if t in eos), None)
        reasons.append("length" if end is None else "eos")
        assert (r.tokens, r.finish_reason) == (theirs[:end], reasons[-1]), i
        assert len(r.logprobs) == len(r.top_logprobs) == len(r.tokens)
        worst = max([worst, *(abs(a - b) for a, b in zip(r.logprobs, chosen[i].tolist()))])
        for t, top in enumerate(r.top_logprobs):
            want = scores[i, t].topk(3)
            assert [j for j, _ in top] == want.indices.tolist(), (i, t)
            worst = max([worst, *(abs(v - w) for (_, v), w in zip(top, want.values.tolist()))])
        # the processed distribution, not the raw one (the penalty moves them apart)
        assert max(abs(a - b) for a, b in zip(r.logprobs, raw[i].tolist())) > 1e-3
    assert {"eos", "length"} <= set(reasons), reasons  # (a row ended early, others ran on)
    assert worst <= 1e-5, worst


def test_sampled_batch_logprobs_are_each_rows_processed_scores(hf):
    ours, ref = hf
    prompts, eos = _prompts(), [5, 6]
    settings = dict(do_sample=True, temperature=0.7, top_k=10, min_new_tokens=3, eos_token_id=eos)
    config = transformers.GenerationConfig(**settings)
    config._eos_token_tensor = torch.tensor(eos)
    sampling = Sampling(temperature=0.7, top_k=10, min_new_tokens=3)
    got = generate(ours, prompts, max_new_tokens=12, sampling=sampling, eos_ids=eos, logprobs=4, seeds=[1, 2, 3],
                   num_samples=2)
    worst = 0.0
    for i, r in enumerate(got):
        prompt = prompts[i // 2]
        processors = ref._get_logits_processor(config, input_ids_seq_length=len(prompt), device="cpu")
        ids = torch.tensor([prompt + r.tokens])
        with torch.no_grad():
            logits = ref(ids).logits[0].float()
        for t, token in enumerate(r.tokens):
            at = len(prompt) + t - 1
            lp = torch.log_softmax(processors(ids[:, :at + 1], logits[at:at + 1].clone()), -1)[0]
            top = lp.topk(4)
            want = [(j, v) for j, v in zip(top.indices.tolist(), top.values.tolist()) if v != float("-inf")]
            assert [j for j, _ in r.top_logprobs[t]] == [j for j, _ in want], (i, t)
            worst = max([worst, abs(r.logprobs[t] - lp[token].item()),
                         *(abs(a[1] - b[1]) for a, b in zip(r.top_logprobs[t], want))])
    assert len({tuple(r.tokens) for r in got}) == 6
    assert worst <= 1e-5, worst


def test_speculation_stops_at_exactly_the_limit():
    target, other = _model(1), _model(2)
    prompt = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    for limit in (1, 2, 5, 7):
        plain = generate(target, [prompt], max_new_tokens=limit, logprobs=2)[0]
        for k in (1, 4):
            for draft in (target, other):  # every proposal kept; almost none
                spec = speculate_one(target, draft, prompt, limit, k=k, sampling=Sampling(), eos_ids=(),
                                     prefill_chunk=64, logprobs=2)
                assert (spec.tokens, spec.finish_reason) == (plain.tokens, "length") and len(spec.tokens) == limit
                assert len(spec.logprobs) == len(spec.top_logprobs) == limit
                assert max(abs(a - b) for a, b in zip(spec.logprobs, plain.logprobs)) <= 1e-5


class Pieces:
    """Each id is one CJK character, or a Latin letter for multiples of 3."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) if i % 3 == 0 else chr(0x4E00 + i) for i in map(int, ids))


def test_a_stop_inside_an_accepted_block_cuts_where_plain_decoding_does(monkeypatch):
    target = _model(1)
    prompt = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    tok, new = Pieces(), 40
    free = generate(target, [prompt], max_new_tokens=new)[0].tokens
    stop = tok.decode(free)[7:10]  # tokens 8-10: inside the second round of 4 kept proposals
    stops = StopStrings(tok, [stop])
    plain = generate(target, [prompt], max_new_tokens=new, stop=stops, logprobs=1)[0]
    assert plain.finish_reason == "stop" and len(plain.tokens) == 10
    monkeypatch.setattr(longctx.progress, "on_terminal", lambda: False)
    for k in (3, 4):
        whole = speculate_one(target, target, prompt, new, k=k, sampling=Sampling(), eos_ids=(), prefill_chunk=64)
        spec = speculate_one(target, target, prompt, new, k=k, sampling=Sampling(), eos_ids=(), prefill_chunk=64,
                             stop=stops, logprobs=1)
        assert (spec.tokens, spec.finish_reason) == (plain.tokens, "stop") and len(spec.logprobs) == 10
        assert max(abs(a - b) for a, b in zip(spec.logprobs, plain.logprobs)) <= 1e-5
        # the rounds end at the stop, as plain decoding does (they ran on to the limit: 40 tokens decoded,
        # and the rate counted the 9 kept over the 40's seconds), the same rounds as the whole run's until then
        assert spec.passes < whole.passes and spec.accepted == whole.accepted[:spec.passes]
        assert sum(spec.accepted) + spec.passes >= len(spec.tokens) - 1
        assert spec.decode_tokens_per_s * spec.decode_seconds == pytest.approx(len(plain.tokens) - 1)
        output = Output(tok, [stop], "", 1, new, main_rank=True)
        output.file = io.StringIO()
        output.write({"text": "p"}, spec, speculative=True)
        line = json.loads(output.file.getvalue())
        assert line["text"] == tok.decode(free)[:7] and line["tokens"] == free[:10]


def _byte_fallback():
    """A tokenizer.json model and decoder as Llama-2's and Mistral's: byte tokens <0x00>..<0xFF> for what the
    vocabulary lacks, decoded by ByteFallback (a run of byte tokens that is not valid UTF-8: one U+FFFD per
    byte), '▁' for a space, the first space stripped."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "a", "b", "▁a", "▁b", "é", "€", "\n"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])

    class Decoder:
        def decode(self, ids):
            return tok.decode([int(i) for i in ids])

    def ids(text: str, rng: random.Random | None = None) -> list[int]:
        """Byte tokens, or (with `rng`) a vocabulary piece half the time where there is one."""
        out = []
        for c in text:
            key = "▁" if c == " " else c
            piece = key in vocab and rng is not None and rng.random() < 0.5
            out += [vocab[key]] if piece else [vocab[f"<0x{b:02X}>"] for b in c.encode()]
        return out

    return Decoder(), ids


def test_a_stop_at_the_end_of_a_long_byte_run_is_seen():
    tok, ids = _byte_fallback()
    for run in (1, 5, 11):
        text = "𝄞" * run + "é€"
        tokens = ids(text)
        assert tok.decode(tokens) == text
        stops = StopStrings(tok, ["é€"])
        assert next((n for n in range(1, len(tokens) + 1) if stops(0, tokens[:n])), None) == len(tokens), run


def test_the_stream_and_echo_show_the_json_text_with_a_byte_fallback_tokenizer(monkeypatch):
    tok, ids = _byte_fallback()
    monkeypatch.setattr(longctx.progress, "on_terminal", lambda: True)
    rng = random.Random(0)
    for trial in range(200):
        text = "".join(rng.choice(["é", "€", "𝄞", "a", "b", " ", "\n"]) for _ in range(rng.randint(1, 10)))
        tokens = ids(text, rng)
        stops = rng.sample(["é€", "a b", "\n\n", "𝄞a"], rng.randint(0, 2))
        checker, taken, reason = StopStrings(tok, stops) if stops else None, [], "length"
        shown, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(shown):
            output = Output(tok, stops, "", 1, len(tokens), main_rank=True)
            output.file = out
            for t in tokens:  # (the engine's order: streamed, then the stop checked)
                taken.append(t)
                output.on_token(0, t)
                if checker is not None and checker(0, taken):
                    reason = "stop"
                    break
            output.write({"text": "p"}, Result(1, taken, reason, 1.0, 1.0), speculative=False)
        line = json.loads(out.getvalue())["text"]
        whole = tok.decode(taken)
        cut = min([whole.find(s) for s in stops if s in whole], default=len(whole))
        assert shown.getvalue()[:-1] == line == whole[:cut], (trial, text, stops)
    # --echo: the continuation after a prompt ending in a byte run is the whole decoding less the prompt's
    prompt, after = ids("𝄞𝄞é"), ids("€ a")  # (the prompt's last 8 tokens begin inside a character)
    assert continuation_text(tok, prompt, after) == tok.decode(prompt + after)[len(tok.decode(prompt)):] == "€ a"
