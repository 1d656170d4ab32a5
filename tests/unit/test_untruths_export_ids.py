"""`longctx checkpoint export` writes the special token ids the weights mean into config.json
(issue 53 item 10): transformers' classes default missing ones (LlamaConfig: BOS 1, EOS 2), which
for a byte-tokenizer model are the bytes 0x01 and 0x02."""

import json
import warnings

import pytest

transformers = pytest.importorskip("transformers")
import torch.distributed.checkpoint as dcp  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import write_manifest  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402
from longctx.models.hf import save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402


def checkpoint(tmp_path, tokenizer: str, overrides=(), name="checkpoints"):
    """A one-step longctx checkpoint of a 1-layer model (weights saved in one process)."""
    cfg = load_config(overrides=["--model.layers=1", *overrides])
    step = tmp_path / name / "step-00000001"
    step.mkdir(parents=True)
    with warnings.catch_warnings():  # (DCP's "assuming the intent is to save in a single process")
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": build_model(cfg.model).state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_manifest(step, step=1, layout={}, model=to_dict(cfg)["model"], tokenizer=tokenizer)
    return step


def exported(tmp_path, step, name="hf-out"):
    out, _, _, notes = export_hf(step, tmp_path / name)
    return json.loads((out / "config.json").read_text()), transformers.AutoConfig.from_pretrained(out), notes


def test_a_byte_tokenizer_model_carries_bos_256_eos_257(tmp_path):
    written, auto, notes = exported(tmp_path, checkpoint(tmp_path, "byte"))
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (256, 257, None)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (256, 257, None)
    assert not notes


def test_an_hf_init_carries_its_config_ids_also_through_a_longctx_checkpoint(tmp_path):
    base = load_config(overrides=["--model.layers=1"]).model
    hf = save_hf(build_model(base), tmp_path / "base")
    bpe_tokenizer(hf / "tokenizer.json")
    config = json.loads((hf / "config.json").read_text())
    config.update(bos_token_id=1, eos_token_id=[0, 2], pad_token_id=3)  # (a list: Llama-3-instruct's kind)
    (hf / "config.json").write_text(json.dumps(config))
    tok = str((hf / "tokenizer.json").resolve())
    step = checkpoint(tmp_path, tok, [f"--model.init_from=hf:{hf}"])
    written, auto, _ = exported(tmp_path, step)
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, [0, 2], 3)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (1, [0, 2], 3)
    # a run started from that checkpoint: the ids of the Hugging Face config at the chain's start
    second = checkpoint(tmp_path, tok, [f"--model.init_from={step}"], name="second")
    assert exported(tmp_path, second, "hf-second")[1].eos_token_id == [0, 2]


def test_a_tokenizer_json_gives_its_end_of_document_token(tmp_path):
    (tmp_path / "tok").mkdir()
    tok = bpe_tokenizer(tmp_path / "tok" / "tokenizer.json")
    eos = json.loads(tok.read_text())["model"]["vocab"]["</s>"]
    written, auto, _ = exported(tmp_path, checkpoint(tmp_path, str(tok)))
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (None, eos, None)
    assert auto.eos_token_id == eos
    # a tokenizer_config.json beside it that declares a BOS and a pad: those ids too
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "</s>"}, "pad_token": "</s>", "eos_token": "no-such-token"}))
    written, _, _ = exported(tmp_path, checkpoint(tmp_path, str(tok), name="c2"), "o2")
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (eos, eos, eos)


def test_no_record_is_said_and_written_as_null(tmp_path):
    written, auto, notes = exported(tmp_path, checkpoint(tmp_path, None))
    assert all(written[k] is None for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    assert auto.bos_token_id is None  # not LlamaConfig's default 1
    assert any("records no tokenizer" in n for n in notes)
