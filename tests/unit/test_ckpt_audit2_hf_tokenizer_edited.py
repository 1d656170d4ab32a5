"""The export of a run that started from hf:DIR copies DIR's tokenizer files only while DIR's tokenizer.json is
still the one the run trained with (the manifest's tokenizer_identity). A DIR whose tokenizer was replaced since
(another revision downloaded into the same directory) had its new tokenizer.json and generation_config.json
copied beside the weights without a word, ids that mean other text, where `longctx generate` refuses the same
checkpoint ("has changed since") and the export of a run from a plain tokenizer file said so."""

import warnings

import pytest

pytest.importorskip("transformers")
import torch.distributed.checkpoint as dcp  # noqa: E402
from test_export_audit import hf_source  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import write_manifest  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402
from longctx.config.tokenizer import tokenizer_identity  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402


def _run_from_hf(tmp_path):
    """(a checkpoint of a run from hf:DIR recording DIR's tokenizer.json as a run does, DIR)."""
    hf = hf_source(tmp_path)
    tokenizer = str((hf / "tokenizer.json").resolve())  # (config/tokenizer.py model_tokenizer)
    cfg = load_config(overrides=[f"--model.init_from=hf:{hf}"])
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": build_model(cfg.model, seed=1).state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_manifest(step, step=1, layout={}, model=to_dict(cfg)["model"], tokenizer=tokenizer,
                   tokenizer_identity=tokenizer_identity(tokenizer))
    return step, hf


def test_the_source_tokenizer_goes_along_only_while_it_is_the_runs(tmp_path):
    step, hf = _run_from_hf(tmp_path)
    out, copied, why, _ = export_hf(step, tmp_path / "same")
    assert copied == ["tokenizer.json", "generation_config.json"] and why == ""

    bpe_tokenizer(hf / "tokenizer.json", vocab_size=280)  # another tokenizer in DIR since the run
    out, copied, why, _ = export_hf(step, tmp_path / "edited")
    assert copied == [] and "has changed since the run" in why, (copied, why)
    assert not (out / "tokenizer.json").exists()
