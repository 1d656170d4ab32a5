"""Leftovers of the 118 round (helper left2): a tokenizer whose end-of-document token changed with the
special-first rule gets another digest (its stores are rebuilt), others keep theirs; the host budget counts only
the stages a resumed run still has to run; a UTF-16 file whose first line is blank is read as UTF-16; a resumed
DTS run's routing count reuses one meta model."""

import hashlib
import json

import pytest
from test_leftovers118 import _saved_at, host_total
from tokenizers import Tokenizer, models, pre_tokenizers

from longctx.config import load_config
from longctx.data.tokenizer import HFTokenizer, tokenizer_digest

pytestmark = pytest.mark.usefixtures("one_thread")


def _save(folder, vocab, special):
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(special)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_digest_covers_the_end_token_only_where_the_special_first_rule_changed_it(tmp_path):
    """Before 2026-12-07 a vocabulary that learnt '<|endoftext|>' as a word ended documents with it; now with its
    special '</s>'. A store built under the old rule must not be taken for one of the new: its digest differs from
    sha256(tokenizer.json), which every tokenizer whose choice did not change keeps (so none of their stores is
    rebuilt)."""
    changed = _save(tmp_path / "changed", {"[UNK]": 0, "a": 1, "<|endoftext|>": 2}, ["</s>"])
    assert HFTokenizer(changed).eos_id == HFTokenizer(changed).special_tokens()["</s>"]
    assert tokenizer_digest(str(changed)) != hashlib.sha256(changed.read_bytes()).hexdigest()
    assert tokenizer_digest(str(changed.parent)) == tokenizer_digest(str(changed))

    ordinary = [
        _save(tmp_path / "llama3", {"[UNK]": 0, "a": 1}, ["<|end_of_text|>", "<|eot_id|>"]),  # both special
        _save(tmp_path / "plain", {"[UNK]": 0, "a": 1, "<|endoftext|>": 2, "</s>": 3}, []),  # both plain words
        _save(tmp_path / "one", {"[UNK]": 0, "a": 1}, ["</s>"]),
        _save(tmp_path / "first", {"[UNK]": 0, "a": 1, "</s>": 2}, ["<|endoftext|>"]),  # the special one is first
    ]
    for path in ordinary:
        assert tokenizer_digest(str(path)) == hashlib.sha256(path.read_bytes()).hexdigest(), path.parent.name


# -- 2. the host budget and offload_fraction auto count only the stages a resumed run still runs -------------------

STAGED = ["--model.preset=debug", "--train.stages=1024:4,256:6", "--train.device=cpu", "--memory.recompute=none"]


def _host_total(*overrides) -> float:
    return host_total(STAGED, *overrides)


def test_a_resume_past_a_longer_stage_is_counted_at_the_stages_left(tmp_path):
    fresh = _host_total()
    short = _host_total("--train.stages=256:10")
    assert fresh > short  # (the 1024 stage is the largest)
    assert _host_total(f"--checkpoint.resume={_saved_at(tmp_path, 4)}") == short  # steps 5..10: all 256
    assert _host_total(f"--checkpoint.resume={_saved_at(tmp_path, 3)}") == fresh  # step 4 is still 1024's


def test_resume_auto_counts_the_stages_from_the_oldest_candidate(tmp_path):
    """Under checkpoint.resume auto the count starts at the oldest checkpoint the load may fall back to (its
    newest's files may be damaged): with one of step 2 (in the 1024 stage) and step 6, the 1024 stage counts."""
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    _saved_at(root, 6)
    (root / "latest").write_text("step-00000006\n")
    auto = [f"--train.run_dir={tmp_path / 'run'}", "--checkpoint.resume=auto"]
    assert _host_total(*auto) == _host_total("--train.stages=256:10")
    _saved_at(root, 2)
    assert _host_total(*auto) == _host_total()


def test_auto_offload_measures_only_the_stages_left(tmp_path, monkeypatch):
    import torch

    from longctx.job.runtime import Runtime
    from longctx.train import model
    shapes = []
    monkeypatch.setattr(model, "_offload_for_shape",
                        lambda cfg, device, rt, seq_len, batch, *a: shapes.append(seq_len) or (0.5, "why"))
    cfg = load_config(None, [*STAGED, "--memory.offload_fraction=auto", "--memory.recompute=selective",
                             f"--checkpoint.resume={_saved_at(tmp_path, 4)}"])
    model.auto_offload_fraction(cfg, torch.device("cpu"), Runtime.create(cfg, 0, 1, "cpu"), lambda *a: None)
    assert shapes == [256]


# -- 3. a UTF-16 / UTF-32 .jsonl whose first line is blank -----------------------------------------------------------

RECORDS = "".join(json.dumps({"text": f"document {i} " + "word " * 20}) + "\n" for i in range(50))


@pytest.mark.parametrize("blank", ["\n", "\r\n", "\n \n\t\n"])
@pytest.mark.parametrize("encoding, reason", [("utf-16-le", "utf16_file"), ("utf-16-be", "utf16_file"),
                                              ("utf-32-le", "utf32_file"), ("utf-32-be", "utf32_file")])
def test_a_wide_jsonl_whose_first_line_is_blank_is_one_skip(tmp_path, encoding, reason, blank):
    """Its first line, the newline's other byte(s) alone, was too short to tell: one bad line a line."""
    from collections import Counter

    from longctx.data.builder import readers
    path = tmp_path / "x.jsonl"
    path.write_bytes((blank + RECORDS).encode(encoding))
    skipped, damaged = Counter(), []
    assert list(readers.iter_file(path, "x.jsonl", "text", skipped, damaged)) == []
    assert skipped == Counter({reason: 1}) and damaged == ["x.jsonl"]
    if "be" in encoding:  # (the hint's order: big-endian where the first byte is 0)
        assert path.read_bytes()[0] == 0


@pytest.mark.parametrize("blank", ["", "\n", "\r\n\r\n", " \n"])
def test_a_utf8_jsonl_after_blank_lines_reads_every_record_at_its_line(tmp_path, blank):
    from collections import Counter

    from longctx.data.builder import readers
    path = tmp_path / "x.jsonl"
    path.write_bytes((blank + RECORDS).encode())
    skipped = Counter()
    docs = list(readers.iter_file(path, "x.jsonl", "text", skipped))
    assert not skipped and len(docs) == 50
    first = len((blank + "x").splitlines())  # (lines numbered from 1, the blank ones counted)
    assert docs[0].name == f"x.jsonl:{first}" and docs[0].text.startswith("document 0 ")


# -- 4. a resumed DTS run's model, counted again and again, is one object ---------------------------------------------

DTS = ["--model.preset=debug-moe", "--model.moe.router=dts", "--model.moe.experts=8", "--model.moe.top_k=2",
       "--model.moe.dts_steps=10", "--model.moe.dense_layers=0"]


def test_from_step_gives_one_object_per_model_and_step_and_one_meta_model(monkeypatch):
    """The counts remembered per model object (costs/model_states.py per_model) built the meta model again for
    each from_step call of a resumed DTS run: a new object each time."""
    import gc
    import weakref

    from longctx.costs import model_states
    from longctx.memory.peak_routing import from_step, peak_top_k
    m = load_config(None, DTS).model
    first = from_step(m, 5)
    assert from_step(m, 5) is first and peak_top_k(first) == 5
    assert from_step(m, 6) is not first and from_step(m, 0) is m
    built = []
    real = model_states.build_model
    monkeypatch.setattr(model_states, "build_model", lambda *a, **k: built.append(a) or real(*a, **k))
    model_states._param_table(from_step(m, 7))
    model_states._param_table(from_step(m, 7))
    assert len(built) == 1
    kept = weakref.ref(from_step(m, 8))
    del m, first
    gc.collect()
    assert kept() is None  # (dropped with its model)
