"""What `longctx generate` and `longctx eval` say about the model they read (names114).

1. Both named a longctx checkpoint's model "llama runs/a/checkpoints" (its family and folder: ModelConfig.label):
   neither which model it was nor its size. They say its name (the preset it records, with the shape keys the run
   changed), its parameters and the step read, in the one line config/model_name.py model_line makes; hf:DIR keeps
   its own name (family and directory).
2. A draft's training (draft.target: GliDe, Clover) opened with "model: llama TARGET, 0.23M parameters": the
   target's label beside the draft's count. The line names the draft (kind, layers, block, its parameters) and the
   target (name, parameters, step), each with its own figures; generate's speculative line names the draft alike.
3. A GliDe or Clover draft's weights were read by a plain dcp.load, the one checkpoint read with no phase and no
   count; it is read as every other one is (counted_read.py: "checkpoint: reading PATH", its MB counted), into the
   same tensors a plain dcp.load fills.

Every count expected here is the numel of a model built on the meta device (not the cost model's formula the code
says), written as the commands write a count ('0.87M')."""

import json
import sysconfig
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from longctx import progress
from longctx.cli import build_parser
from longctx.config import load_config
from longctx.models.llama import build_model
from phase_spy import record_phases

QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=20",
         "--train.device=cpu", "--metrics.log_interval=1", "--train.seq_len=32", "--train.global_batch=1",
         "--train.steps=1"]


def _millions(n: int) -> str:
    return f"{n / 1e6:.3g}M"


def _meta_count(model_cfg) -> int:
    return sum(p.numel() for p in build_model(model_cfg, device="meta").parameters())


def _train(run: Path, *extra) -> object:
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*QUIET, f"--train.run_dir={run}", *extra]), log=lambda *a, **k: None)
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The debug preset, one step trained and saved by the normal path: its checkpoints directory."""
    run = tmp_path_factory.mktemp("target")
    _train(run)
    return run / "checkpoints"


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target) -> dict:
    """kind -> (its trainer, its checkpoints directory): a 1-layer GliDe draft and a Clover draft of `target`."""
    out = {}
    for kind, extra in (("glide", ["--draft.layers=1"]), ("clover", [])):
        run = tmp_path_factory.mktemp(kind)
        out[kind] = _train(run, f"--draft.target={target}", f"--draft.kind={kind}", *extra), run / "checkpoints"
    return out


def _generate_line(checkpoint, *extra) -> str:
    from longctx.generate.cli import _describe, prepare

    args, rest = build_parser("generate").parse_known_args(
        ["generate", "--checkpoint", str(checkpoint), "--prompt", "ab cd", "--max-new-tokens", "2", *extra])
    return _describe(prepare(args, rest), args, torch.device("cpu"), torch.float32)


# -- 1. generate and eval name the model, its parameters and the step read ----------------------------------------


def test_generate_names_the_checkpoints_preset_its_parameters_and_the_step_read(target):
    count = _meta_count(load_config(None, QUIET).model)  # (the debug preset's)
    line = _generate_line(target)
    assert line.startswith(f"generate: debug ({_millions(count)} parameters), {target} step 1, on cpu ("), line
    assert f"llama {target}" not in line  # (the family and folder it said before)


def test_a_preset_whose_shape_the_run_changed_is_named_with_the_change(tmp_path):
    from longctx.checkpoint.manifest import write_manifest
    from longctx.config.load import to_dict

    cfg = load_config(None, [*QUIET, "--model.layers=1"])
    step = tmp_path / "checkpoints" / "step-00000007"
    step.mkdir(parents=True)
    write_manifest(step, step=7, layout={}, model=to_dict(cfg)["model"], tokenizer="byte")  # (the line reads no weight)
    line = _generate_line(tmp_path / "checkpoints")
    assert line.startswith(f"generate: debug with layers 1 ({_millions(_meta_count(cfg.model))} parameters), "
                           f"{tmp_path / 'checkpoints'} step 7, on cpu"), line


def test_a_checkpoint_of_a_run_from_hugging_face_weights_names_its_family_and_where_it_started(tmp_path):
    from longctx.checkpoint.manifest import write_manifest
    from longctx.config.load import to_dict

    cfg = load_config(None, QUIET)
    origin = f"hf:{tmp_path / 'SmolLM2'}"
    model = {**to_dict(cfg)["model"], "preset": "hf", "init_from": origin}  # (as such a run's manifest records it)
    step = tmp_path / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    write_manifest(step, step=4, layout={}, model=model, tokenizer="byte")
    line = _generate_line(tmp_path / "checkpoints")
    assert line.startswith(f"generate: llama started from {origin} ({_millions(_meta_count(cfg.model))} parameters), "
                           f"{tmp_path / 'checkpoints'} step 4, on cpu"), line


def test_a_hugging_face_directory_keeps_its_own_name(tmp_path):
    from longctx.models.hf import save_hf

    cfg = load_config(None, [*QUIET, "--model.layers=2", "--model.dim=32", "--model.ffn_dim=64"])
    hf = save_hf(build_model(cfg.model, seed=3), tmp_path / "hf")
    count = _meta_count(cfg.model)
    line = _generate_line(f"hf:{hf}", "--tokenizer", "byte")
    assert line.startswith(f"generate: llama {hf} ({_millions(count)} parameters), on cpu ("), line
    from longctx.costs.model_states import model_said

    m = load_config(None, {"model": {"init_from": f"hf:{hf}"}, "train": {"seq_len": 2, "eval_interval": 0}}).model
    assert model_said(m, f"hf:{hf}") == f"llama {hf} ({_millions(count)} parameters)"


def test_eval_says_the_same_model_line_and_records_it_in_the_result(target, tmp_path, capsys, monkeypatch):
    from longctx import threads
    from longctx.eval.command import main

    monkeypatch.setattr(threads, "fit_to_idle_cores", lambda *a, **k: None)  # (this process's threads left as set)

    text = tmp_path / "long.py"
    text.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text())
    out = tmp_path / "passkey.json"
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", str(target), "--task", "passkey", "--mode", "generate", "--lengths", "160",
         "--depths", "0.5", "--samples", "1", "--data", str(text), "--output", str(out)])
    args.argv = []
    assert main(args, rest) == 0
    want = f"debug ({_millions(_meta_count(load_config(None, QUIET).model))} parameters), {target} step 1"
    assert json.loads(out.read_text())["model"] == want
    assert f"eval: model {want}\n" in capsys.readouterr().err


# -- 2. a draft's line: the draft and its target, each with its own figures ---------------------------------------


@pytest.mark.parametrize("kind, words", [("glide", "a 1-layer GliDe draft"), ("clover", "a Clover draft")])
def test_a_draft_runs_model_line_names_the_draft_and_the_target_each_with_its_figures(target, drafts, kind, words):
    from longctx.train.run_lines import describe_run

    trainer, _ = drafts[kind]
    drafted = sum(p.numel() for p in trainer.model.draft.parameters())
    whole = _meta_count(load_config(None, QUIET).model)
    assert drafted < whole / 2  # (two figures far apart: the one said as the other's would show)
    dims = SimpleNamespace(dp_replicate=1, dp_shard=1, head=1, ctx=1, window=0, placement="head-first", expert=1)
    line = describe_run(trainer.cfg, 1, dims, trainer.model, torch.device("cpu"), torch.float32, "peak P")[0]
    assert line.startswith(f"model: {words} (block 4, {_millions(drafted)} parameters) against the target debug "
                           f"({_millions(whole)} parameters), {target} step 1, cpu float32"), line


def test_a_fine_tunes_model_line_names_the_model_and_the_step_it_starts_from(target, tmp_path):
    """A run from a longctx checkpoint (model.init_from) said "model: llama CHECKPOINTS, 0.87M parameters"."""
    from longctx.train.run_lines import describe_run
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*QUIET, f"--train.run_dir={tmp_path}", f"--model.init_from={target}"]),
                      log=lambda *a, **k: None)
    dims = SimpleNamespace(dp_replicate=1, dp_shard=1, head=1, ctx=1, window=0, placement="head-first", expert=1)
    line = describe_run(trainer.cfg, 1, dims, trainer.model, torch.device("cpu"), torch.float32, "peak P")[0]
    whole = _meta_count(load_config(None, QUIET).model)
    assert line.startswith(f"model: debug ({_millions(whole)} parameters), {target} step 1, cpu float32"), line


def test_generates_speculative_line_names_the_drafts_kind_parameters_and_step(target, drafts):
    from longctx.checkpoint.glide import glide_manifest, load_glide_draft
    from longctx.checkpoint.weights_only import load_model_weights
    from longctx.generate.drafts import draft_label

    model = build_model(load_config(None, {"model": {"init_from": str(target)}, "train": {
        "seq_len": 2, "eval_interval": 0}}).model, seed=0)
    load_model_weights(target / "step-00000001", model)
    _, checkpoints = drafts["glide"]
    draft = load_glide_draft(checkpoints, model, "cpu")
    n = sum(p.numel() for p in draft.parameters())
    assert draft_label(glide_manifest(checkpoints), str(checkpoints), draft) == \
        f"a 1-layer GliDe draft (block 4, {_millions(n)} parameters) from {checkpoints} step 1"


# -- 3. a draft's read is counted, into the same tensors ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_a_drafts_read_is_the_counted_read_and_loads_a_plain_dcp_loads_tensors(target, drafts, kind, monkeypatch):
    from longctx.checkpoint.glide import build_draft, glide_manifest, read_draft_weights

    monkeypatch.setenv(progress.INTERVAL_ENV, "20")  # (lines on: rank 0 speaks; the read takes far less)
    monkeypatch.delenv("RANK", raising=False)
    made = record_phases(monkeypatch.setattr)
    _, checkpoints = drafts[kind]
    record = glide_manifest(checkpoints)
    step = Path(record["checkpoint"])
    cfg = load_config(None, {"model": {"init_from": str(target)}, "train": {"seq_len": 2, "eval_interval": 0}}).model
    counted = build_draft(record, cfg)
    read_draft_weights(step, counted)
    (read,) = [p for p in made if p.what == f"checkpoint: reading {step}"]
    assert read.unit == "MB" and read.total > 0 and read.values[-1] == read.total, (read.total, read.values)
    assert read.values == sorted(read.values) and len(read.values) > 3, read.values  # (item by item, only up)
    shards = sum(p.stat().st_size for p in step.glob("*.distcp")) / 1e6
    tensors = sum(t.numel() * t.element_size() for t in counted.state_dict().values()) / 1e6
    assert tensors <= read.total < shards, (tensors, read.total, shards)  # (the draft's: not its optimizer's beside)
    plain = {f"draft.{k}": torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v)
             for k, v in build_draft(record, cfg).state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": plain}, checkpoint_id=str(step), no_dist=True)
    mine = counted.state_dict()
    assert set(mine) == {k.removeprefix("draft.") for k in plain}
    for key, value in plain.items():
        a = mine[key.removeprefix("draft.")]
        assert a.dtype == value.dtype and a.shape == value.shape, key
        assert torch.equal(a.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
