"""`longctx eval` on hf:DIR prompts the model as `longctx generate` (and transformers) would: with the
special tokens its tokenizer puts before a text (e.g. BOS), in --mode generate and --mode score alike,
each sequence still `length` tokens long. A tokenizer that adds none, the byte tokenizer and a
longctx checkpoint trained before its documents began with them are unchanged.

The model's calls are replaced by recorders: what is checked is the tokens it would be given."""

import json
import shutil

import numpy as np
import pytest
from test_tokenizer_follows_model import bpe_tokenizer
from tokenizers import Tokenizer, processors

import longctx.eval.runner
import longctx.generate.engine
from longctx.cli import build_parser
from longctx.config import load_config
from longctx.config.tokenizer import model_text_prefix as special_prefix
from longctx.data.samples import IGNORE
from longctx.data.tokenizer import HFTokenizer
from longctx.errors import DataError
from longctx.eval.generate_mode import answer_start, evaluate_generate
from longctx.eval.request import prepare
from longctx.eval.score_mode import evaluate_score
from longctx.generate.results import Result
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

LENGTH = 128
TEXT = "def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 60


def _bos_tokenizer(path):
    """The small BPE tokenizer with a BOS that its post-processor puts before every text (as Llama's)."""
    bpe_tokenizer(path)
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(path))
    return bos


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(an hf:DIR whose tokenizer adds BOS, one whose tokenizer adds nothing, a text file for filler)."""
    tmp = tmp_path_factory.mktemp("prefix")
    model = build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=320"]).model, seed=1)
    with_bos, plain = save_hf(model, tmp / "bos"), save_hf(model, tmp / "plain")
    _bos_tokenizer(with_bos / "tokenizer.json")
    bpe_tokenizer(plain / "tokenizer.json")
    text = tmp / "filler.py"
    text.write_text(TEXT)
    return with_bos, plain, text


def _eval(monkeypatch, checkpoint, text, mode, *extra):
    """The prompts (--mode generate) or sequences (--mode score) eval gives the model, and the result."""
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", checkpoint, "--task", "passkey", "--lengths", str(LENGTH), "--depths", "0,0.5,1",
         "--samples", "1", "--data", str(text), "--mode", mode, *extra])
    request = prepare(args, rest, 1)
    seen = []

    def fake_generate(model, prompts, **kw):
        seen.extend(list(p) for p in prompts)
        return [Result(len(p), [], "length", 1.0, 1.0) for p in prompts]

    def fake_score(model, rt, seqs, *a, **kw):
        seen.extend(seqs)
        n = len(seqs)
        return {"nll_sum": [0.0] * args.buckets, "tokens": [0.0] * args.buckets, "nll": [0.0] * n,
                "misses": [0.0] * n, "scored": [1.0] * n}

    monkeypatch.setattr(longctx.generate.engine, "generate", fake_generate)
    monkeypatch.setattr(longctx.eval.runner, "score", fake_score)
    result = (evaluate_generate if mode == "generate" else evaluate_score)(request, args)
    return seen, request.sequences[LENGTH], result


def _generates_prefix(folder, text: str) -> list[int]:
    """What `longctx generate --checkpoint hf:DIR` puts before the tokens of `text`."""
    from longctx.generate.cli import prepare as generate_prepare

    args, rest = build_parser("generate").parse_known_args(
        ["generate", "--checkpoint", f"hf:{folder}", "--prompt", text])
    ids = generate_prepare(args, rest).prompts[0]["ids"]
    tok = HFTokenizer(folder / "tokenizer.json")
    return ids[:len(ids) - len(tok.encode(text))]


def test_generate_mode_prompts_carry_the_bos_generate_gives(folders, monkeypatch):
    with_bos, _, text = folders
    bos = HFTokenizer(with_bos / "tokenizer.json")._tok.token_to_id("<s>")
    prompts, seqs, result = _eval(monkeypatch, f"hf:{with_bos}", text, "generate")
    tok = HFTokenizer(with_bos / "tokenizer.json")
    assert len(prompts) == len(seqs) == 3
    for prompt, q in zip(prompts, seqs):
        own = q.tokens[:answer_start(q)].tolist()
        prefix = _generates_prefix(with_bos, tok.decode(own))
        assert prefix == [bos]
        assert prompt == prefix + own  # the same text, with what generate puts before it
    assert result["special_prefix"] == [bos]
    assert [r["length"] for r in result["results"]] == [LENGTH] * 3


def test_score_mode_sequences_carry_it_too_and_keep_their_length(folders, monkeypatch):
    """The BOS takes the place of the sequence's last token, which is only a label: `length` tokens
    read, every answer token still scored, and the context before the answer that generate mode gives."""
    with_bos, _, text = folders
    bos = HFTokenizer(with_bos / "tokenizer.json")._tok.token_to_id("<s>")
    seqs, originals, result = _eval(monkeypatch, f"hf:{with_bos}", text, "score")
    gen_prompts, _, _ = _eval(monkeypatch, f"hf:{with_bos}", text, "generate")
    assert len(seqs) == len(originals) == 3
    for q, o, prompt in zip(seqs, originals, gen_prompts):
        assert q.length == len(q.tokens) == len(q.labels) == LENGTH
        assert q.tokens.tolist() == [bos] + o.tokens[:-1].tolist()
        scored = q.labels != IGNORE
        assert q.labels[scored].tolist() == o.labels[o.labels != IGNORE].tolist()  # every answer token
        assert (q.labels[:-1][scored[:-1]] == q.tokens[1:][scored[:-1]]).all()  # label t is token t + 1
        assert q.labels[-1] == o.tokens[-1]  # the last answer token: the label of the last position
        assert q.tokens[:answer_start(q)].tolist() == prompt  # what generate mode is given
        assert (q.depth, q.answer) == (o.depth, o.answer)
    assert result["special_prefix"] == [bos]


@pytest.mark.parametrize("case", ["no BOS tokenizer", "byte tokenizer"])
def test_tokenizers_that_add_nothing_leave_the_prompts_alone(folders, monkeypatch, case):
    with_bos, plain, text = folders
    bare = with_bos.parent / "bare"  # (weights without a tokenizer of their own take --tokenizer byte)
    if not bare.is_dir():
        bare.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(with_bos / name, bare / name)
    checkpoint, extra = (f"hf:{plain}", ()) if case == "no BOS tokenizer" else (f"hf:{bare}", ("--tokenizer", "byte"))
    prompts, seqs, result = _eval(monkeypatch, checkpoint, text, "generate", *extra)
    assert prompts == [q.tokens[:answer_start(q)].tolist() for q in seqs]
    scored, originals, result_score = _eval(monkeypatch, checkpoint, text, "score", *extra)
    assert all(np.array_equal(a.tokens, b.tokens) and np.array_equal(a.labels, b.labels)
               for a, b in zip(scored, originals))
    assert "special_prefix" not in result and "special_prefix" not in result_score
    json.dumps(result)


def test_a_longctx_checkpoint_gets_the_prefix_its_manifest_records(folders, tmp_path):
    """`longctx generate` puts before a longctx checkpoint's prompts the special tokens its training documents
    began with (its manifest's text_prefix; none when it records none, as before they were recorded): eval too."""
    with_bos, _, _ = folders
    tok = HFTokenizer(with_bos / "tokenizer.json")
    bos = tok._tok.token_to_id("<s>")
    for name, record in (("old", {}), ("new", {"text_prefix": [bos]})):
        step = tmp_path / name / "step-00000001"
        step.mkdir(parents=True)
        (step / "manifest.json").write_text(json.dumps({"step": 1, **record}))
    assert special_prefix(str(tmp_path / "old"), tok) == []
    assert special_prefix(str(tmp_path / "new"), tok) == [bos]
    assert special_prefix(f"hf:{with_bos}", tok) == [bos]


def test_two_prefix_tokens_prompt_generate_mode_and_are_refused_by_score_mode(folders, tmp_path, monkeypatch):
    """Score mode has room for one prefix token (the place of the last token, only a label): more would
    leave answer tokens unscored, so it says so; generate mode prompts with them all."""
    with_bos, _, text = folders
    two = tmp_path / "two"
    two.mkdir()
    for f in with_bos.iterdir():
        (two / f.name).write_bytes(f.read_bytes())
    tok = Tokenizer.from_file(str(two / "tokenizer.json"))
    tok.add_special_tokens(["<x>"])
    ids = [tok.token_to_id("<s>"), tok.token_to_id("<x>")]
    tok.post_processor = processors.TemplateProcessing(single="<s> <x> $A", special_tokens=list(zip(["<s>", "<x>"],
                                                                                                     ids)))
    tok.save(str(two / "tokenizer.json"))
    prompts, seqs, _ = _eval(monkeypatch, f"hf:{two}", text, "generate")
    assert prompts == [ids + q.tokens[:answer_start(q)].tolist() for q in seqs]
    with pytest.raises(DataError, match="puts 2 special tokens.*Use --mode generate"):
        _eval(monkeypatch, f"hf:{two}", text, "score")
