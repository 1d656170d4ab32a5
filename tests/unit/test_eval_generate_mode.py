"""`longctx eval --mode generate`, host side: what each prompt's draws are seeded from, and how the answer
is read from the generated tokens. The model's generate() is replaced by a recorder; what is checked is
what eval gives it and what eval makes of what it returns."""

import pytest
from test_tokenizer_follows_model import bpe_tokenizer
from tokenizers import Tokenizer

import longctx.generate.engine
from longctx.cli import build_parser
from longctx.config import load_config
from longctx.data.tokenizer import ByteTokenizer, HFTokenizer
from longctx.eval.generate_mode import answer_start, evaluate_generate, parse_answer
from longctx.eval.request import prepare
from longctx.generate.results import Result
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TEXT = "def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 60
BYTE = ByteTokenizer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(an hf:DIR of a random one-layer model, read with the byte tokenizer; a text file for filler)."""
    tmp = tmp_path_factory.mktemp("gen")
    hf = save_hf(build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=320"]).model, seed=1),
                 tmp / "hf")
    text = tmp / "filler.py"
    text.write_text(TEXT)
    return hf, text


def _generate(monkeypatch, folder, lengths: str, answer=None, *extra):
    """((length, depth, sample, seed) of each prompt, in the order generate() was given them; the result).
    `answer(q)`: the new tokens the fake model writes for sequence q (default: none)."""
    hf, text = folder
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", "passkey", "--lengths", lengths,
         "--depths", "0,0.5", "--samples", "2", "--data", str(text), "--mode", "generate", *extra])
    request = prepare(args, rest, 1)
    by_prompt = {tuple(q.tokens[:answer_start(q)].tolist()): q for seqs in request.sequences.values() for q in seqs}
    seen = []

    def fake_generate(model, prompts, seeds=None, **kw):
        qs = [by_prompt[tuple(p)] for p in prompts]
        seen.extend((q.length, q.depth, q.sample, s) for q, s in zip(qs, seeds))
        return [Result(len(p), answer(q) if answer else [], "length", 1.0, 1.0) for p, q in zip(prompts, qs)]

    monkeypatch.setattr(longctx.generate.engine, "generate", fake_generate)
    return seen, evaluate_generate(request, args)


def test_sampled_draws_at_a_length_do_not_depend_on_the_other_lengths(folder, monkeypatch):
    """Each sequence's draws are seeded from what it is (length, depth, sample) and --seed, never from its
    place in the run: --lengths 160 and --lengths 128,160 sample the same at 160."""
    alone, _ = _generate(monkeypatch, folder, "160", None, "--temperature", "1.0")
    both, _ = _generate(monkeypatch, folder, "128,160", None, "--temperature", "1.0")
    at_160 = [s for s in both if s[0] == 160]
    assert alone == at_160
    assert len({s[3] for s in both}) == len(both) == 8  # every sequence its own stream
    # and --batch changes nothing either
    batched, _ = _generate(monkeypatch, folder, "128,160", None, "--temperature", "1.0", "--batch", "3")
    assert sorted(batched) == sorted(both)


def _ids(text: str) -> list[int]:
    return BYTE.encode(text).tolist()


def test_a_token_that_decodes_to_nothing_ends_the_answer(folder, monkeypatch):
    """The model writes the key's first digits, a BOS (or an id past the tokenizer's 258) and the rest:
    the decoded text would read as the key, but the key was not written as a run of digits, and score
    mode (every answer token the argmax) calls it a miss. The answer is read up to that token."""
    def answer(q):
        key = q.answer
        if q.sample == 0:  # a clean answer, then the stop
            return _ids(f" {key}.")
        return _ids(f" {key[:3]}") + [BYTE.bos_id if q.depth == 0 else 300] + _ids(f"{key[3:]}.")

    _, result = _generate(monkeypatch, folder, "128", answer)
    for r in result["results"]:
        assert r["per_sample"] == [True, False], r
        assert r["generated"][1] == f" {r['answers'][1][:3]}"  # the text the answer was read from


def test_answer_text_cuts_at_the_first_vanishing_token(tmp_path):
    from longctx.eval.generate_mode import answer_text

    assert answer_text(BYTE, _ids(" 714") + [256] + _ids("32.")) == " 714"
    assert answer_text(BYTE, _ids(" 714") + [319] + _ids("32.")) == " 714"
    assert answer_text(BYTE, _ids(" 71432.")) == " 71432."
    assert answer_text(BYTE, []) == ""
    assert parse_answer(answer_text(BYTE, _ids(" 71") + [257])) == "71"
    # a Hugging Face tokenizer: its special tokens (skipped by decode) and ids past its vocabulary
    # vanish; a byte piece that is half a character does not
    path = bpe_tokenizer(tmp_path / "tokenizer.json")
    raw = Tokenizer.from_file(str(path))
    raw.add_special_tokens(["<s>"])
    raw.save(str(path))
    tok = HFTokenizer(path)
    bos = raw.token_to_id("<s>")
    digits = [int(i) for i in tok.encode(" 71432.")]
    assert answer_text(tok, digits) == " 71432."
    assert answer_text(tok, digits[:2] + [bos] + digits[2:]) == tok.decode(digits[:2])
    assert answer_text(tok, digits[:1] + [tok.vocab_size + 5] + digits[1:]) == tok.decode(digits[:1])
    half = [int(i) for i in tok.encode("é")][:1]  # (ByteLevel: one piece per UTF-8 byte)
    assert answer_text(tok, half + digits) == tok.decode(half + digits)


def test_a_leading_metaspace_survives(tmp_path):
    """A SentencePiece-style decoder strips the text's first space, so '▁' alone decodes to '': still a
    token of the text, not one that ends the answer."""
    from tokenizers import decoders, models, normalizers, trainers

    from longctx.eval.generate_mode import answer_text

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=[chr(c) for c in range(32, 127)] + ["▁"])
    tok.train_from_iterator(["The pass key is 7 1 4 3 2. Remember it."] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    t = HFTokenizer(tmp_path / "tokenizer.json")
    space = tok.token_to_id("▁")
    digits = [tok.token_to_id(c) for c in "71432"]
    assert t.decode([space]) == ""
    assert parse_answer(answer_text(t, [space, *digits])) == "71432"
    assert parse_answer(answer_text(t, [space, *digits[:2], tok.token_to_id("<s>"), *digits[2:]])) == "71"
    assert None not in digits


def test_the_result_records_every_rope_setting(folder, monkeypatch):
    """The JSON's `rope` holds every model.rope_* key (the scaling's factor and original length, Ms-PoE's
    settings), so a result says which extension it measured."""
    yarn = ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=128",
            "--model.rope_ms_poe=true", "--model.rope_ms_poe_max=1.5", "--model.rope_ms_poe_skip_layers=0"]
    _, result = _generate(monkeypatch, folder, "128", None, *yarn)
    rope = result["rope"]
    assert rope["scaling"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_len"] == 128
    assert rope["ms_poe"] is True and rope["ms_poe_max"] == 1.5 and rope["ms_poe_skip_layers"] == 0
    assert rope["theta"] == load_config(overrides=["--model.layers=1"]).model.rope_theta


def test_the_rope_record_holds_only_the_settings_the_scaling_reads():
    """Scaling none records no factor or original length (the defaults 8 and 8192 read as an extension that
    was not applied); llama3 its four settings; Ms-PoE off, no Ms-PoE ratios."""
    from longctx.eval.results import rope_record

    def record(*args):
        return rope_record(load_config(overrides=["--model.layers=1", *args]).model)

    assert set(record("--model.rope_scaling=none")) == {"theta", "scaling", "ms_poe"}
    assert set(record("--model.rope_scaling=linear", "--model.rope_factor=2")) == {"theta", "scaling", "ms_poe",
                                                                                 "factor"}
    llama3 = record("--model.rope_scaling=llama3", "--model.rope_factor=4")
    assert set(llama3) == {"theta", "scaling", "ms_poe", "factor", "low_freq_factor", "high_freq_factor",
                           "original_max_len"} and llama3["factor"] == 4.0
    poe = record("--model.rope_ms_poe=true", "--model.rope_ms_poe_skip_layers=0")
    assert poe["ms_poe"] is True and {"ms_poe_min", "ms_poe_max", "ms_poe_order", "ms_poe_skip_layers"} <= set(poe)
