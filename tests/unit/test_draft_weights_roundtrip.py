"""benchmarks/draft_weights.py: a draft trained on a lent GPU comes back as its weights alone (a device call returns
8 files of 16 MiB at most) and is imported here as a draft checkpoint beside the same target imported on this
machine, whose config.json differs (another transformers version writes it) and so whose weights identity does:
the imported draft proposes exactly what the trained one did (fp32), `longctx generate --draft` takes it, and a
target with other weights is refused."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from longctx.checkpoint.glide import load_glide_draft
from longctx.checkpoint.identity import weights_identity
from longctx.config import load_config
from longctx.generate.drafters import drafter_for
from longctx.generate.speculative import speculative_generate
from longctx.train.trainer import Trainer
from probes import DRAFT_QUIET, tiny_target_run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from draft_agreement import target_model, teacher_forced_logits  # noqa: E402
from draft_weights import DraftWeightsError, export_weights, import_weights, main  # noqa: E402

QUIET = lambda *a, **k: None  # noqa: E731


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny target as a Hugging Face directory (the GPU's import), a copy of it whose config.json another
    writer wrote (this machine's), and a GliDe and a Clover draft trained 2 steps against the first."""
    from longctx.checkpoint.export import export_hf

    base = tmp_path_factory.mktemp("draft-weights")
    corpus, checkpoints = tiny_target_run(base)
    export_hf(checkpoints, base / "there")
    here = base / "here"
    shutil.copytree(base / "there", here)
    config = json.loads((here / "config.json").read_text())
    (here / "config.json").write_text(json.dumps({**config, "transformers_version": "9.99.0"}, indent=1))
    for kind in ("glide", "clover"):
        Trainer(load_config(None, [*DRAFT_QUIET, *corpus, f"--draft.target=hf:{base / 'there'}", "--train.steps=2",
                                   f"--draft.kind={kind}", "--draft.vocab=64", "--draft.block=3",
                                   f"--train.run_dir={base / kind}"]), log=QUIET).run()
    return base


def _speculate(target, draft, prompt: list[int]):
    with torch.inference_mode():
        return speculative_generate(target, drafter_for(target, draft, 128), prompt, max_new_tokens=24, k=3)


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_the_imported_draft_proposes_what_the_trained_one_did(runs, kind, tmp_path):
    assert weights_identity(f"hf:{runs / 'here'}") != weights_identity(f"hf:{runs / 'there'}")
    files = export_weights(runs / kind / "checkpoints", kind, tmp_path / "out")
    assert files and all(f.stat().st_size < 16 << 20 for f in files)
    step = import_weights(kind, tmp_path / "out", f"hf:{runs / 'here'}", tmp_path / kind / "checkpoints")
    assert step.name == "step-00000002"
    there, here = target_model(f"hf:{runs / 'there'}"), target_model(f"hf:{runs / 'here'}")
    trained = load_glide_draft(runs / kind / "checkpoints", there)
    imported = load_glide_draft(tmp_path / kind / "checkpoints", here)
    for (name, a), b in zip(trained.state_dict().items(), imported.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(teacher_forced_logits(there, trained, ids), teacher_forced_logits(here, imported, ids))
    prompt = ids[0, :20].tolist()
    a, b = _speculate(there, trained, prompt), _speculate(here, imported, prompt)
    assert (a.tokens, a.accepted, a.proposed) == (b.tokens, b.accepted, b.proposed)


def test_generate_takes_the_imported_draft_and_refuses_the_trained_one_beside_the_other_import(runs, tmp_path,
                                                                                              capsys):
    """The trained draft's record names the target it met (its identity); the import's names the target here."""
    from longctx.cli import main as longctx

    export_weights(runs / "glide" / "checkpoints", "glide", tmp_path / "out")
    import_weights("glide", tmp_path / "out", f"hf:{runs / 'here'}", tmp_path / "glide")
    common = ["generate", "--checkpoint", f"hf:{runs / 'here'}", "--prompt", "def return", "--max-new-tokens", "6",
              "--speculate", "3", "--tokenizer", "byte"]
    assert longctx([*common, "--draft", str(tmp_path / "glide")]) == 0
    capsys.readouterr()
    assert longctx([*common, "--draft", str(runs / "glide" / "checkpoints")]) != 0
    assert "holds other weights" in " ".join(capsys.readouterr().err.split())


def test_a_target_with_other_weights_is_refused_unless_asked(runs, tmp_path):
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(runs / "here", other)
    shard = next(other.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(shard), metadata={"format": "pt"})
    export_weights(runs / "glide" / "checkpoints", "glide", tmp_path / "out")
    with pytest.raises(DraftWeightsError, match="holds other weights"):
        import_weights("glide", tmp_path / "out", f"hf:{other}", tmp_path / "glide")
    assert not (tmp_path / "glide").exists() or not list((tmp_path / "glide").iterdir())
    step = import_weights("glide", tmp_path / "out", f"hf:{other}", tmp_path / "glide", other_weights_ok=True)
    assert json.loads((step / "manifest.json").read_text())["draft"]["imported"]["other_weights"] is True


def test_bf16_in_several_files_is_close_and_a_missing_file_is_named(runs, tmp_path):
    files = export_weights(runs / "glide" / "checkpoints", "glide", tmp_path / "out", dtype="bf16",
                           max_bytes=40_000)
    assert len(files) > 2
    import_weights("glide", tmp_path / "out", f"hf:{runs / 'here'}", tmp_path / "glide")
    here = target_model(f"hf:{runs / 'here'}")
    trained = load_glide_draft(runs / "glide" / "checkpoints", here).state_dict()
    imported = load_glide_draft(tmp_path / "glide", here).state_dict()
    for k, v in trained.items():
        assert torch.allclose(v.float(), imported[k].float(), rtol=1e-2, atol=1e-6) if v.is_floating_point() else \
            torch.equal(v, imported[k]), k
    files[1].unlink()
    assert main(["import", "glide", "--from", str(tmp_path / "out"), "--target", f"hf:{runs / 'here'}", "--out",
                 str(tmp_path / "again")]) == 1
