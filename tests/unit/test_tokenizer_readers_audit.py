"""The readers of a tokenizer record that still compared tokenizers by path, or not at all (audit 'tokfollow'),
now compare them by content (config/tokenizer.py tokenizer_identity), as generate and eval's --tokenizer do:

- a draft (generate/drafts.py): its tokenizer file moved was refused with advice for training
  (data.tokenizer=byte), and a file edited at its recorded path was taken as the draft's own;
- an eval store (eval/inputs.py): its tokenizer file moved was refused the same way, an edited one trusted;
- bench decode's --tokenizer was never checked against the target's weights, nor a --data store's ids;
- export's config.json took BOS / EOS from the recorded tokenizer file edited since the run.

A moved but identical file is taken; an edited or different one is refused before work, naming both; a
record written before longctx recorded content behaves as before (its file as it is now).
"""

import hashlib
from types import SimpleNamespace

import pytest

pytest.importorskip("tokenizers")
from test_data_build import opts, quiet  # noqa: E402
from test_export_audit import checkpoint  # noqa: E402  (a 1-step, 1-layer longctx checkpoint)
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.checkpoint.export import special_token_ids  # noqa: E402
from longctx.checkpoint.manifest import read_manifest, write_manifest  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.errors import UserError  # noqa: E402
from longctx.generate.drafts import draft_config  # noqa: E402


def sha(path):
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def other_tokenizer(path):
    """A tokenizer.json of another content whose EOS (</s>) is id 1, not 0 as bpe_tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["print(1)\n", "x = [a for a in b]\n"] * 40, trainer)
    tok.save(str(path))
    return path


def recorded(step, tokenizer, identity=None, draft=None):
    """Rewrite the checkpoint `step`'s manifest to record `tokenizer` (and its content `identity`; a GliDe
    `draft` record), as a run of this longctx (or, without `identity`, of an older one) writes it."""
    m = read_manifest(step)
    write_manifest(step, step=1, layout={}, model=m["model"], tokenizer=tokenizer, tokenizer_identity=identity,
                   draft=draft)
    return step


def _draft(tmp_path, tok, identity, glide):
    step = checkpoint(tmp_path, str(tok), ["--model.vocab_size=320"], name="draft")
    model = read_manifest(step)["model"]
    record = {"kind": "glide", "layers": 1, "block": 4, "target": {"path": "t", "model": model}} if glide else None
    return recorded(step, str(tok), identity, record)


def _target_cfg(tmp_path, spec):
    target = checkpoint(tmp_path, spec, ["--model.vocab_size=320"], name="target")
    return target, load_config(None, {"model": {"init_from": str(target)}, "train": {"seq_len": 2,
                                                                                     "eval_interval": 0}})


@pytest.mark.parametrize("glide", [False, True], ids=["model draft", "glide draft"])
def test_a_drafts_tokenizer_is_compared_by_content(tmp_path, glide):
    tok = bpe_tokenizer(tmp_path / "tok.json").resolve()
    draft = _draft(tmp_path, tok, sha(tok), glide)
    moved = tmp_path / "moved.json"
    tok.rename(moved)
    target, cfg = _target_cfg(tmp_path, str(moved))
    draft_config(str(draft), str(target), 2, cfg, str(moved))  # before: "does not exist; pass data.tokenizer=byte"
    # the draft's file edited at its recorded path into the target's other tokenizer: before, taken as the draft's own
    other = other_tokenizer(tmp_path / "other.json")
    tok.write_bytes(other.read_bytes())
    with pytest.raises(UserError) as e:
        draft_config(str(draft), str(target), 2, cfg, str(other))
    msg = " ".join(str(e.value).split())
    assert f"--draft {draft} was trained with the tokenizer {tok}" in msg and sha(moved) in msg, msg
    assert sha(other) in msg and "must share the target's tokenizer" in msg, msg


def test_a_draft_without_the_record_whose_file_moved_is_refused_with_a_fix_for_generate(tmp_path):
    tok = bpe_tokenizer(tmp_path / "tok.json").resolve()
    draft = _draft(tmp_path, tok, None, False)
    target, cfg = _target_cfg(tmp_path, str(tok))
    draft_config(str(draft), str(target), 2, cfg, str(tok))  # (as before: its file as it is now)
    moved = tmp_path / "moved.json"
    tok.rename(moved)
    with pytest.raises(UserError) as e:  # before: "pass data.tokenizer=byte", a training option
        draft_config(str(draft), str(target), 2, cfg, str(moved))
    msg = " ".join(str(e.value).split())
    assert "data.tokenizer" not in msg and "no longer exists" in msg and f"back at {tok}" in msg, msg


@pytest.fixture
def store(tmp_path):
    """(a store built with the BPE tokenizer `tok`, tok, its content)."""
    (tmp_path / "tok").mkdir()
    tok = bpe_tokenizer(tmp_path / "tok" / "tokenizer.json")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.py").write_text("def f(x):\n    return x + 1\n" * (3 + i))
    build_store(opts([docs], tmp_path / "store", 64, tokenizer=str(tok), strategy="bfd", dedup="none",
                     eval_fraction=0.5), log=quiet)
    return tmp_path / "store", tok, tok.read_bytes()


def _eval_source(store, spec):
    from longctx.eval.inputs import _load_source

    args = SimpleNamespace(data=str(store), split="train", checkpoint="")
    return _load_source(args, SimpleNamespace(model=SimpleNamespace(vocab_size=320)), spec, None)


def test_an_eval_stores_tokenizer_is_compared_by_the_content_it_records(store, tmp_path):
    root, tok, content = store
    moved = tmp_path / "moved.json"
    tok.rename(moved)
    assert _eval_source(root, str(moved)).tokenizer_spec == str(tok.resolve())  # before: "does not exist"
    other = other_tokenizer(tmp_path / "other.json")
    tok.write_bytes(other.read_bytes())  # the store's file edited into the checkpoint's: before, trusted
    with pytest.raises(UserError) as e:
        _eval_source(root, str(tok))
    msg = " ".join(str(e.value).split())
    assert f"was tokenized with {tok.resolve()}" in msg and sha(moved) in msg and sha(other) in msg, msg


def test_bench_decode_checks_its_tokenizer_against_the_target(store, tmp_path):
    from longctx.bench.decode import _models

    root, tok, content = store
    target = recorded(checkpoint(tmp_path, str(tok.resolve()), ["--model.vocab_size=320"]), str(tok.resolve()),
                      sha(tok))
    other = other_tokenizer(tmp_path / "other.json")
    draft = recorded(checkpoint(tmp_path, None, ["--model.vocab_size=320"], name="draft"), None)  # (names none)
    args = SimpleNamespace(target=str(target), tokenizer=str(other), draft=str(draft), speculate=4,
                           speculate_adaptive="false", draft_cost=None, verify_cost=None, confidence_stop=0.0,
                           draft_window=None, compile="false")
    with pytest.raises(UserError) as e:  # before: taken, the target fed another tokenizer's ids
        _models(args)
    assert f"--tokenizer {other} is not the tokenizer" in " ".join(str(e.value).split())
    moved = tmp_path / "moved.json"
    moved.write_bytes(content)
    args.tokenizer = str(moved)
    assert _models(args)[3] == str(moved)  # the same content elsewhere is the target's


def test_bench_decode_refuses_a_store_of_another_tokenizer(store, tmp_path):
    from longctx.bench.decode import _prompts

    root, tok, content = store
    target = checkpoint(tmp_path, str(tok.resolve()), ["--model.vocab_size=320"])
    other = other_tokenizer(tmp_path / "other.json")
    with pytest.raises(UserError, match="was tokenized with"):  # before: the store's ids taken as the target's
        _prompts(SimpleNamespace(prompts="", data=str(root), lengths="8", samples=1, target=str(target)),
                 None, str(other))


def test_export_takes_no_special_ids_from_a_tokenizer_edited_since_the_run(tmp_path):
    tok = bpe_tokenizer(tmp_path / "tok.json").resolve()
    step = recorded(checkpoint(tmp_path, str(tok)), str(tok), sha(tok))
    assert special_token_ids(read_manifest(step)) == ({"bos_token_id": None, "eos_token_id": 0,
                                                        "pad_token_id": None}, "")
    tok.write_bytes(other_tokenizer(tmp_path / "other.json").read_bytes())  # its EOS is 1
    ids, note = special_token_ids(read_manifest(step))  # before: eos_token_id 1, the edited file's, without a word
    assert ids == {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}, ids
    assert f"the run's tokenizer {tok} has changed since the run" in note, note
    # a checkpoint without the record takes its file as it is now, as before
    old = recorded(checkpoint(tmp_path, str(tok), name="old"), str(tok))
    assert special_token_ids(read_manifest(old))[0]["eos_token_id"] == 1
