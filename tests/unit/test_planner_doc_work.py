"""The planner's documents: the attention work a store's documents leave (doc_work), counted against a dense
mask, and how `longctx plan` reads it from --store or --data.path (split from test_planner.py)."""

import pytest

from longctx.errors import ConfigError


def _store(tmp_path, name, seq_len, lengths, seed=0):
    """A byte-tokenized store (bfd packing, no dedup) of random documents of `lengths` characters
    (each becomes length + 1 tokens with its end-of-document token)."""
    import json
    import random

    from longctx.data.builder.options import BuildOptions
    from longctx.data.builder.pipeline import build_store

    rng = random.Random(seed)
    src = tmp_path / f"{name}.jsonl"
    with src.open("w") as f:
        for n in lengths:
            f.write(json.dumps({"text": "".join(rng.choice("abcdefghij klmnopq") for _ in range(n))}) + "\n")
    out = tmp_path / name
    build_store(BuildOptions(inputs=[str(src)], out=str(out), seq_len=seq_len, strategy="bfd", dedup="none",
                             stats=False, progress=False), log=lambda *a, **k: None)
    return out


def _brute_force_doc_work(root, indices):
    """Mean over the samples of (causal AND same-document pairs) / causal pairs, with a dense mask."""
    import torch

    from longctx.data.loader import PackedSamples

    samples = PackedSamples(root, "train", True)
    ratios = []
    for i in indices:
        doc = samples.batch([int(i)]).doc_ids[0]
        s = doc.numel()
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        ratios.append(float((causal & (doc[:, None] == doc[None, :])).sum()) / float(causal.sum()))
    return sum(ratios) / len(ratios)


def test_doc_work_of_a_store_equals_a_dense_mask_count(tmp_path):
    from longctx.data.loader import PackedSamples
    from longctx.planner.documents import doc_work_of_ids, sample_indices, store_doc_work

    assert doc_work_of_ids([[0, 0, 1, 1, 1, 2]]) == pytest.approx((3 + 6 + 1) / 21)
    lengths = [30, 50, 10, 63, 100, 5, 7, 200, 41, 12, 17, 90, 3, 64, 25]
    root = _store(tmp_path, "mixed", 64, lengths)
    n = len(PackedSamples(root, "train", True))
    work, used, total = store_doc_work(root, 64)
    assert (used, total) == (n, n) and n >= 8
    assert work == pytest.approx(_brute_force_doc_work(root, range(n)), rel=1e-12)
    assert 0 < work < 1
    # at most `limit` samples, evenly spaced and the same every time
    small, used, _ = store_doc_work(root, 64, limit=3)
    assert used == 3 and list(sample_indices(n, 3)) == [0, n // 3, 2 * n // 3]
    assert small == pytest.approx(_brute_force_doc_work(root, sample_indices(n, 3)), rel=1e-12)
    assert store_doc_work(root, 64, limit=3)[0] == small


def test_one_document_per_sample_is_doc_work_one_up_to_padding(tmp_path):
    from longctx.planner.documents import store_doc_work

    # 63 characters + the end-of-document token fill a 64-token sample exactly: one document each
    full = _store(tmp_path, "full", 64, [63] * 6)
    assert store_doc_work(full, 64)[0] == 1.0
    # 59 + 1 tokens and 4 of padding, which is attended like a document of its own
    padded = _store(tmp_path, "padded", 64, [59] * 6)
    work = store_doc_work(padded, 64)[0]
    assert work == pytest.approx((60 * 61 + 4 * 5) / (64 * 65), rel=1e-12)
    assert 1 - 2 * 4 / 64 < work < 1


def test_store_with_another_seq_len_is_a_config_error_naming_both(tmp_path):
    import argparse

    from longctx.planner.cli import add_arguments, build_request

    root = _store(tmp_path, "s64", 64, [30, 40, 50])
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--gpus", "2", "--seq-len", "128", "--store", str(root)])
    with pytest.raises(ConfigError, match=r"64 tokens.*--seq-len is 128"):
        build_request(args, [])
    args = p.parse_args(["--gpus", "2", "--seq-len", "64", "--store", str(root)])
    req, _ = build_request(args, [])
    assert 0 < req.doc_work < 1 and str(root) in req.doc_work_source
    with pytest.raises(ConfigError, match="not a longctx data store"):
        build_request(p.parse_args(["--gpus", "2", "--seq-len", "64", "--store", str(tmp_path / "none")]), [])
    req, _ = build_request(p.parse_args(["--gpus", "2", "--seq-len", "64"]), [])
    assert req.doc_work == 1.0 and req.doc_work_source == "no --store: one document per sequence assumed"


def test_a_data_path_store_gives_the_plan_its_documents(tmp_path):
    """--data.path names the store the plan's config trains: its documents are the attention work (as --store's),
    not one document per sequence; a store of another length is refused at plan time, naming data.path."""
    import argparse

    from longctx.planner.cli import add_arguments, build_request
    from longctx.planner.documents import store_doc_work

    root = _store(tmp_path, "s64", 64, [30, 40, 50, 20, 10])
    p = argparse.ArgumentParser()
    add_arguments(p)
    req, _ = build_request(p.parse_args(["--gpus", "2", "--seq-len", "64"]), [f"--data.path={root}"])
    assert req.doc_work == store_doc_work(root, 64)[0] < 1 and req.doc_work_source.startswith(f"from data.path {root}")
    with pytest.raises(ConfigError, match=r"data.path .* holds samples of 64 tokens.*--seq-len is 128"):
        build_request(p.parse_args(["--gpus", "2", "--seq-len", "128"]), [f"--data.path={root}"])
