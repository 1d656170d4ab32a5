"""Shard scans made before --dedup-threshold without minhash was refused (3151722) took it with --dedup exact or none,
and ignored it, and their plan.json records it: `longctx data merge` rebuilt the options from there and refused them
('drop it', which merge has no flag for), and a machine that scanned again without the flag was 'scanned with other
options' than one that had not. A threshold that changes no document no longer stops the merge."""

import json

from test_data_build import quiet
from test_data_stream import corpus, opts, small_shards  # noqa: F401 (a fixture)

from longctx.data.builder.pipeline import build_store, merge_scans
from longctx.data.loader import PackedSamples


def _scan(src, out, i, threshold=None):
    build_store(opts([src], out, shard=(i, 2), dedup="exact"), log=quiet)
    if threshold is not None:  # (as the older version wrote it)
        plan = next(out.rglob("plan.json"))
        p = json.loads(plan.read_text())
        p["build"]["dedup_threshold"] = threshold
        plan.write_text(json.dumps(p))
    return str(out)


def test_scans_with_an_ignored_threshold_merge(tmp_path, small_shards):  # noqa: F811
    src = corpus(tmp_path / "in", seed=4)
    build_store(opts([src], tmp_path / "one", dedup="exact"), log=quiet)
    older = [_scan(src, tmp_path / f"old{i}", i, threshold=0.7) for i in range(2)]
    merge_scans(older, str(tmp_path / "m"), progress=False, log=quiet)
    mixed = [_scan(src, tmp_path / "new0", 0), older[1]]  # (one machine scanned again, without the flag)
    merge_scans(mixed, str(tmp_path / "mixed"), progress=False, log=quiet)
    want = len(PackedSamples(tmp_path / "one", "train"))
    assert len(PackedSamples(tmp_path / "m", "train")) == len(PackedSamples(tmp_path / "mixed", "train")) == want
