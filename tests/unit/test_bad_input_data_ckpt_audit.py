"""Bad input to `longctx data build | merge` and `longctx checkpoint verify | export | import`: one clear
error before any work, never a raw traceback from deep in the work, a silent wrong store, or a user's
files deleted. Each case here did one of those before (audit 'baddata')."""

import json
import warnings

import numpy as np
import pytest

from longctx.checkpoint.gguf_import import GGUFImportError, import_gguf
from longctx.checkpoint.manifest import CheckpointError, write_manifest
from longctx.checkpoint.verify_command import verify_lines
from longctx.cli import main
from longctx.data.builder.options import BuildOptions, check_options
from longctx.data.builder.pipeline import build_store, merge_scans
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import DataError


def quiet(*_args, **_kw):
    pass


def corpus(root):
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text("the first document, about rivers and the sea.\n" * 3)
    (root / "b.txt").write_text("a second one on mountains, snow and ice.\n" * 3)
    return root


def build(inputs, out, **kw):
    kw = {"seq_len": 32, "strategy": "concat", "dedup": "exact", "workers": 1, "progress": False, "stats": False,
          **kw}
    return build_store(BuildOptions(inputs=[str(i) for i in inputs], out=str(out), **kw), log=quiet)


def stored_names(store_dir):
    return {json.loads(line)["name"] for line in (store_dir / "part-00000" / "docs.jsonl").read_text().splitlines()}


# ------------------------------------------------------------------------------------------------
# data build / merge


def test_a_build_into_a_directory_of_someone_elses_files_is_refused_and_they_survive(tmp_path):
    """A build removes unlisted part-* and its .build under --out: it deleted a user's part-notes/ and .build/."""
    out = tmp_path / "project"
    (out / "part-notes").mkdir(parents=True)
    (out / "part-notes" / "n.txt").write_text("precious")
    (out / ".build").mkdir()
    (out / ".build" / "cache.txt").write_text("a project's build cache")
    (out / "readme.txt").write_text("mine")
    with pytest.raises(DataError, match="holds files that are not a data store's"):
        build([corpus(tmp_path / "docs")], out)
    assert (out / "part-notes" / "n.txt").read_text() == "precious"
    assert (out / ".build" / "cache.txt").read_text() == "a project's build cache"
    assert sorted(p.name for p in out.iterdir()) == [".build", "part-notes", "readme.txt"]


def test_a_shard_scan_or_merge_into_another_directory_is_refused(tmp_path):
    """A shard scan that starts over removes its whole --out; a merge into a scan directory mixed a store into it."""
    docs = corpus(tmp_path / "docs")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not a shard scan's"):
        build([docs], mine, shard=(0, 1))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    build([docs], tmp_path / "scan", shard=(0, 1))
    with pytest.raises(DataError, match=r"not a data store's \(plan.json, shards\)"):
        merge_scans([str(tmp_path / "scan")], str(tmp_path / "scan"), log=quiet)
    assert not (tmp_path / "scan" / "manifest.json").exists()
    build([docs], tmp_path / "store")
    with pytest.raises(DataError, match="already holds a data store; a merge writes a new store") as e:
        merge_scans([str(tmp_path / "scan")], str(tmp_path / "store"), log=quiet)
    assert "--append" not in str(e.value)  # (data merge has no --append)


def test_a_store_beside_the_corpus_is_not_read_as_its_documents(tmp_path):
    """Stores of one corpus at several lengths kept in its directory: the second build read the first's
    manifest.json as a training document (and refused nothing when pointed at a store itself)."""
    docs = corpus(tmp_path / "docs")
    build([docs], docs / "store-32")
    build([docs], tmp_path / "store-64", seq_len=64)
    assert stored_names(tmp_path / "store-64") == {"a.txt", "b.txt"}
    with pytest.raises(DataError, match="is a data store written by `longctx data build`, not documents"):
        build([docs / "store-32"], tmp_path / "store-again")
    assert not (tmp_path / "store-again").exists()


@pytest.mark.parametrize("field, value, phrase", [
    ("max_docs", -1, "--max-docs must be >= 0"),  # was: 'every document is a duplicate', after the scan
    ("clusters", -2, "--clusters must be >= 0"),  # was: silently one cluster (no clustering)
    ("seq_len", 3_000_000_000, "raise --max-memory or lower --seq-len"),  # was: 100 s, a 6 GB sample of padding
])
def test_nonsense_numbers_are_refused_before_work(tmp_path, field, value, phrase):
    opts = BuildOptions(inputs=["stdlib"], out=str(tmp_path / "s"), **{"seq_len": 32, field: value})
    with pytest.raises(DataError, match=phrase):
        check_options(opts)


def test_a_file_that_is_not_a_tokenizer_is_a_data_error(tmp_path):
    """The tokenizers library raised a bare Exception ('expected `,` or `}`'), a traceback."""
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"a" 1}')
    with pytest.raises(DataError, match="is not a tokenizer.json the tokenizers library reads"):
        load_tokenizer(str(bad))


def test_an_out_under_a_file_is_refused(tmp_path):
    """NotADirectoryError from mkdir, a traceback."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="which is a file, not a directory"):
        build([corpus(tmp_path / "docs")], tmp_path / "file" / "store")


def test_a_damaged_scan_plan_is_a_data_error(tmp_path):
    """`data merge DIR` on a directory whose plan.json is not JSON: a JSONDecodeError traceback."""
    (tmp_path / "scan").mkdir()
    (tmp_path / "scan" / "plan.json").write_text("{oops")
    with pytest.raises(DataError, match="is not a scan plan of `longctx data build`"):
        merge_scans([str(tmp_path / "scan")], str(tmp_path / "store"), log=quiet)


def test_an_append_to_a_store_that_lost_a_part_is_refused_before_the_scan(tmp_path):
    """A FileNotFoundError traceback, after every input was scanned."""
    docs = corpus(tmp_path / "docs")
    out = tmp_path / "store"
    build([docs / "a.txt"], out)
    (out / "part-00000" / "hashes.npy").unlink()
    with pytest.raises(DataError, match="part-00000/hashes.npy is missing"):
        build([docs / "b.txt"], out, append=True)
    assert not (out / ".build").exists()  # refused before the scan


# ------------------------------------------------------------------------------------------------
# checkpoint verify / export / import


def test_verify_of_a_manifest_without_its_file_list_is_a_damaged_manifest(tmp_path):
    """A manifest without a checksum of its own (older, or edited) is read as it is: a KeyError traceback."""
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "__0_0.distcp").write_bytes(b"x" * 100)
    write_manifest(step, step=1, layout={}, model={"family": "llama"}, tokenizer="byte")
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["checksum"], manifest["files"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="lacks or garbles files"):
        verify_lines(step)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    from longctx.config import load_config
    from longctx.config.load import to_dict
    from longctx.models.llama import build_model

    cfg = load_config(overrides=["--model.layers=1"])
    step = tmp_path_factory.mktemp("ckpt") / "step-00000001"
    step.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": build_model(cfg.model, seed=1).state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_manifest(step, step=1, layout={}, model=to_dict(cfg)["model"], tokenizer="byte")
    return step


@pytest.mark.parametrize("shard_gb", ["0", "-1", "nan"])
def test_export_with_a_shard_size_of_nothing_is_refused(tiny_checkpoint, tmp_path, capsys, shard_gb):
    """--max-shard-gb 0 wrote every tensor to a file of its own; nan was a ValueError traceback."""
    out = tmp_path / "out"
    assert main(["checkpoint", "export", str(tiny_checkpoint), str(out), "--max-shard-gb", shard_gb]) == 1
    assert "expected a size in GiB above 0" in " ".join(capsys.readouterr().err.split())
    assert not out.exists()


def test_export_and_import_into_a_path_under_a_file_are_refused_before_reading_weights(tiny_checkpoint, tmp_path,
                                                                                        capsys):
    """Export read every weight, then died in mkdir with a FileExistsError traceback; import likewise."""
    (tmp_path / "file").write_text("x")
    assert main(["checkpoint", "export", str(tiny_checkpoint), str(tmp_path / "file" / "out")]) == 1
    assert "is a file" in " ".join(capsys.readouterr().err.split())
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # (refused on its output before the file is read further)
    with pytest.raises(GGUFImportError, match="which is a file, not a directory"):
        import_gguf(gguf, tmp_path / "file" / "out")


def test_a_gguf_whose_metadata_lacks_the_vocabulary_is_refused_before_the_weights_are_read(tmp_path, monkeypatch):
    """transformers fills a missing vocabulary (or any hyperparameter) with LlamaConfig's defaults: a file
    without them was built as a 32,000-token (without any: a 6.6B-parameter) fp32 model before its weights were
    found missing, minutes and gigabytes later."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from longctx.checkpoint import gguf_import

    path = tmp_path / "partial.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.ones((16, 8), np.float32))  # 16 tokens; no token list in the metadata
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def weights_read(*_args, **_kw):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(gguf_import, "load_model", weights_read)
    with pytest.raises(GGUFImportError, match="metadata does not describe its tensors") as e:
        import_gguf(path, tmp_path / "out")
    assert "vocabulary 32,000" in str(e.value)
    assert not (tmp_path / "out").exists()
