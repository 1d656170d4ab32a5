"""`longctx checkpoint export` writes OUT whole or not at all (checkpoint/export.py): a second export into
the same directory kept the first one's tokenizer.json and generation_config.json beside the new weights
(transformers then encoded a byte-tokenizer model's text with another model's BPE and stopped generation
at its EOS), and an export that failed after the weights were written left a directory that looked
complete with config.json's special ids missing (LlamaConfig's BOS 1 / EOS 2 instead)."""

import errno
import json
import warnings

import pytest

transformers = pytest.importorskip("transformers")
import torch.distributed.checkpoint as dcp  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.checkpoint import export  # noqa: E402
from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import CheckpointError, write_manifest  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402
from longctx.models.hf import save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402


def checkpoint(tmp_path, tokenizer, overrides=(), name="checkpoints"):
    """A one-step longctx checkpoint of a 1-layer model (weights saved in one process)."""
    cfg = load_config(overrides=["--model.layers=1", *overrides])
    step = tmp_path / name / "step-00000001"
    step.mkdir(parents=True)
    with warnings.catch_warnings():  # (DCP's "assuming the intent is to save in a single process")
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": build_model(cfg.model, seed=1).state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_manifest(step, step=1, layout={}, model=to_dict(cfg)["model"], tokenizer=tokenizer)
    return step


def hf_source(tmp_path):
    """A Hugging Face directory with a BPE tokenizer.json and a generation_config.json (EOS 5)."""
    hf = save_hf(build_model(load_config(overrides=["--model.layers=1"]).model), tmp_path / "source")
    bpe_tokenizer(hf / "tokenizer.json")
    (hf / "generation_config.json").write_text(json.dumps({"bos_token_id": 4, "eos_token_id": 5}))
    return hf


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_second_export_into_the_same_directory_keeps_nothing_of_the_first(tmp_path):
    hf = hf_source(tmp_path)
    first = checkpoint(tmp_path, str((hf / "tokenizer.json").resolve()), [f"--model.init_from=hf:{hf}"], "a")
    out = tmp_path / "out"
    export_hf(first, out)
    assert {"tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    export_hf(checkpoint(tmp_path, "byte", name="b"), out)  # a byte-tokenizer model, into the same OUT
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "longctx_export.json", "model.safetensors"]
    assert json.loads((out / "longctx_export.json").read_text())["step"] == 1
    assert transformers.AutoConfig.from_pretrained(out).eos_token_id == 257
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left


def _disk_full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_an_export_that_fails_midway_leaves_out_as_it_was(tmp_path, monkeypatch):
    step = checkpoint(tmp_path, "byte")
    fresh, previous = tmp_path / "fresh", tmp_path / "previous"
    export_hf(step, previous)
    before = snapshot(previous)
    monkeypatch.setattr(export, "special_token_ids", _disk_full)  # (fails after the weights are written)
    for out in (fresh, previous):
        with pytest.raises(CheckpointError, match="No space left.*Nothing was written"):
            export_hf(step, out)
    assert not fresh.exists()  # not a directory that looks like an export without its ids
    assert snapshot(previous) == before  # the previous export is intact: ids, weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "previous"]


def test_a_directory_holding_other_files_or_the_source_model_is_refused_untouched(tmp_path):
    hf = hf_source(tmp_path)
    step = checkpoint(tmp_path, str((hf / "tokenizer.json").resolve()), [f"--model.init_from=hf:{hf}"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before_source = snapshot(hf)
    for out, said in ((mine, "notes.txt"), (hf, "started from")):
        with pytest.raises(CheckpointError, match=said):
            export_hf(step, out)
    assert (mine / "notes.txt").read_text() == "keep me"
    assert snapshot(hf) == before_source  # the source model's config.json and weights were overwritten before


def test_a_downloaded_model_directory_is_refused_untouched(tmp_path):
    """A Hugging Face model directory holds only names an export writes (config.json, the weights, the
    tokenizer files): the export replaced it whole, deleting a model that was not longctx's to delete."""
    downloaded = hf_source(tmp_path)  # (config.json, model.safetensors, tokenizer.json, generation_config.json)
    before = snapshot(downloaded)
    with pytest.raises(CheckpointError, match="did not export"):
        export_hf(checkpoint(tmp_path, "byte"), downloaded)
    assert snapshot(downloaded) == before


def test_a_run_started_from_a_checkpoint_of_an_hf_run_exports_the_models_tokenizer_files(tmp_path):
    """hf:DIR -> run A -> run B (model.init_from = A's checkpoint): B's export carried only tokenizer.json,
    losing DIR's tokenizer_config.json (special tokens, chat template) and generation_config.json that A's
    export carries; config.json's ids already came from DIR through the chain."""
    hf = hf_source(tmp_path)
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "{{ 'x' }}"}))
    tok = str((hf / "tokenizer.json").resolve())
    a = checkpoint(tmp_path, tok, [f"--model.init_from=hf:{hf}"], "a")
    b = checkpoint(tmp_path, tok, [f"--model.init_from={a}"], "b")
    want = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name, step in (("a", a), ("b", b)):
        out, copied, _, _ = export_hf(step, tmp_path / f"out-{name}")
        assert sorted(copied) == want, name
        assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "</s>"
    # another tokenizer than DIR's (a run that named its own): only the run's tokenizer.json goes along
    (tmp_path / "other").mkdir()
    other = bpe_tokenizer(tmp_path / "other" / "tokenizer.json", vocab_size=280)
    c = checkpoint(tmp_path, str(other), [f"--model.init_from={a}"], "c")
    assert export_hf(c, tmp_path / "out-c")[1] == ["tokenizer.json"]


def test_generation_from_a_checkpoint_of_an_hf_run_stops_at_the_models_eos_ids(tmp_path):
    """generate / eval from a checkpoint of an hf:DIR run (an instruct fine-tune, say) stopped only at the
    tokenizer's end-of-document token, not at DIR's generation_config.json eos ids (an end of turn among
    them): it wrote past its turn. Now they follow the chain while the tokenizer is DIR's."""
    from longctx.data.tokenizer import load_tokenizer
    from longctx.generate.loading import eos_ids

    hf = hf_source(tmp_path)
    (hf / "generation_config.json").write_text(json.dumps({"bos_token_id": 4, "eos_token_id": [5, 7]}))
    tok = str((hf / "tokenizer.json").resolve())
    a = checkpoint(tmp_path, tok, [f"--model.init_from=hf:{hf}"], "a")
    b = checkpoint(tmp_path, tok, [f"--model.init_from={a}"], "b")
    assert eos_ids(f"hf:{hf}", load_tokenizer(tok)) == [5, 7]
    assert eos_ids(str(b), load_tokenizer(tok)) == [5, 7]
    (tmp_path / "other").mkdir()
    other = bpe_tokenizer(tmp_path / "other" / "tokenizer.json", vocab_size=280)
    c = checkpoint(tmp_path, str(other), [f"--model.init_from={a}"], "c")  # (another tokenizer: its own eos)
    assert eos_ids(str(c), load_tokenizer(str(other))) == [load_tokenizer(str(other)).eos_id]


def test_a_preset_run_with_a_tokenizer_file_exports_the_files_that_declare_its_special_tokens(tmp_path):
    """data.tokenizer = DIR/tokenizer.json on a preset model: config.json took its special ids from the
    tokenizer_config.json beside it, but only tokenizer.json went along, so AutoTokenizer on the export
    had no eos_token. Now the files that declare them go too."""
    (tmp_path / "tok").mkdir()
    tok = bpe_tokenizer(tmp_path / "tok" / "tokenizer.json", vocab_size=280)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    step = checkpoint(tmp_path, str(tok))
    out, copied, _, _ = export_hf(step, tmp_path / "out")
    assert sorted(copied) == ["tokenizer.json", "tokenizer_config.json"]
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "</s>"
