"""`longctx plan --store DIR` (or --data.path) writes the store as the plan's data.path, so the store must
fit the run the plan writes, as `longctx train` checks it (train/setup.py _check_store): a store whose
tokenizer has more ids than the model's vocabulary, or (under data.doc_mask = false, where no document
is costed) of another sequence length, was written into "the best runnable plan", which train then refused.
Refused by the plan, before planning, saying what to change."""

import argparse

import pytest
from test_planner_doc_work import _store

from longctx.errors import ConfigError
from longctx.planner.cli import add_arguments, build_request


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def _request(root, seq_len, *overrides, flag="--store"):
    argv = ["--model", "debug", "--gpus", "1", "--seq-len", str(seq_len), "--hardware", "h100"]
    if flag == "--store":
        return build_request(_args([*argv, "--store", str(root)]), list(overrides))
    return build_request(_args(argv), [f"--data.path={root}", *overrides])


@pytest.mark.parametrize("flag", ["--store", "data.path"])
def test_a_store_of_more_token_ids_than_the_model_has_is_refused(tmp_path, flag):
    from longctx.data.store import read_manifest

    root = _store(tmp_path, "s", 64, [30, 50, 10, 63, 100, 5])
    ids = int(read_manifest(root)["tokenizer"]["vocab_size"])
    with pytest.raises(ConfigError, match=f"{flag} .*{ids} tokens.*--model.vocab_size={ids}"):
        _request(root, 64, f"--model.vocab_size={ids - 2}", flag=flag)
    req, base = _request(root, 64, f"--model.vocab_size={ids}", flag=flag)  # (enough ids: planned)
    assert base.data.path and req.doc_work < 1


@pytest.mark.parametrize("flag", ["--store", "data.path"])
def test_a_store_of_another_length_is_refused_without_document_masks_too(tmp_path, flag):
    root = _store(tmp_path, "s", 64, [30, 50, 10, 63, 100, 5])
    with pytest.raises(ConfigError, match="holds samples of 64 tokens.*--seq-len is 128"):
        _request(root, 128, "--data.doc_mask=false", flag=flag)
