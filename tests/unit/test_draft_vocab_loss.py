"""The loss denominator of a step (train/trainer.py) when the model scores fewer labels than the batch
holds: a GliDe draft with a reduced vocabulary (draft.vocab) and draft.loss = ce ignores every label
outside its vocabulary, so the step's loss, its gradient and the evaluation loss are means over the
labels it scores, not over all the batch's valid labels (whose count would scale the loss by the
in-vocabulary share, and each step's gradient by that step's share). And a step with no label to
score: its loss is NaN (a mean over no token), its update is not applied, and the run goes on."""

import pytest
import torch

import longctx.train.step_run as step_run
from longctx.config import load_config
from longctx.data.samples import IGNORE
from longctx.parallel.context.shares import read_local_batch, to_device
from longctx.train.trainer import Trainer

QUIET = ["--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=64", "--train.global_batch=4",
         "--train.warmup_steps=1", "--train.eval_interval=0", "--data.tokenizer=byte"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from test_glide_training import word_documents

    return word_documents(tmp_path_factory.mktemp("vocab-docs"), 120, 40)


@pytest.fixture(scope="module")
def target(tmp_path_factory, corpus):
    run = tmp_path_factory.mktemp("vocab-target")
    cfg = load_config(None, [*QUIET, *corpus, "--model.layers=2", "--model.dim=64", "--model.ffn_dim=128",
                             "--train.steps=2", "--checkpoint.interval=2", f"--train.run_dir={run}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return run / "checkpoints"


def _draft(tmp_path, corpus, target, *extra) -> Trainer:
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={target}", "--draft.layers=1", "--draft.vocab=12",
                             "--draft.loss=ce", "--train.grad_clip=0", "--train.steps=3", "--train.grad_accum=2",
                             f"--train.run_dir={tmp_path}", *extra])
    return Trainer(cfg, log=lambda *a, **k: None, read_ahead=False)


def _scored(trainer, labels) -> int:
    vocab = trainer.model.draft.vocab
    return int((vocab.labels(labels, IGNORE, trainer.cfg.model.vocab_size) != IGNORE).sum())


def _recording(monkeypatch):
    """Record each micro-batch the trainer's step runs, and the gradients it hands the optimizer."""
    seen = {"batches": [], "grads": None}
    forward = step_run.forward_loss_sum

    def recorded(model, batch, autocast_dtype):
        seen["batches"].append(batch)
        return forward(model, batch, autocast_dtype)

    def step(optimizer, apply):
        seen["grads"] = [p.grad.clone() for g in optimizer.param_groups for p in g["params"]]
        seen["apply"] = bool(apply)
        return guarded(optimizer, apply)

    guarded = step_run.guarded_step
    monkeypatch.setattr(step_run, "forward_loss_sum", recorded)
    monkeypatch.setattr(step_run, "guarded_step", step)
    return seen


def test_the_step_loss_and_gradient_are_means_over_the_scored_labels(tmp_path, corpus, target, monkeypatch):
    trainer = _draft(tmp_path, corpus, target)
    seen = _recording(monkeypatch)
    loss = float(trainer.step(1)[0])
    batches = seen["batches"]
    scored = sum(_scored(trainer, b.labels) for b in batches)
    valid = sum(int((b.labels != IGNORE).sum()) for b in batches)
    assert 0 < scored < 0.9 * valid  # (the vocabulary leaves labels out: the bug would show)
    assert seen["apply"]
    # the reference, at the weights the step started from (a fresh trainer: the same seed, target and
    # vocabulary): each micro-batch's summed loss over the step's scored labels, one backward each
    fresh = _draft(tmp_path / "again", corpus, target)
    total = 0.0
    for b in batches:
        s = fresh.model(b.tokens, b.positions, b.doc_ids, labels=b.labels, loss_reduction="sum")
        (s / scored).backward()
        total += float(s.detach())
    assert loss == pytest.approx(total / scored, rel=1e-6)
    ref = [p.grad for g in fresh.optimizer.param_groups for p in g["params"]]
    for got, want in zip(seen["grads"], ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_evaluation_is_a_mean_over_the_scored_labels(tmp_path, corpus, target):
    trainer = _draft(tmp_path, corpus, target, "--train.eval_interval=100", "--data.eval_fraction=0.2",
                     "--train.eval_batches=2")
    samples, micro = trainer.eval_samples, trainer.micro_step_sequences
    n = min(len(samples), trainer.cfg.train.eval_batches * trainer.sampler.stage.global_batch)
    n = n // trainer.sampler.stage.global_batch * trainer.sampler.stage.global_batch
    assert n > 0
    total, scored, valid = 0.0, 0, 0
    with torch.no_grad():
        trainer.model.eval()
        for start in range(0, n, micro):
            share, _ = read_local_batch(trainer.rt, samples, list(range(start, start + micro)))
            b = to_device(share, trainer.device)
            total += float(trainer.model(b.tokens, b.positions, b.doc_ids, labels=b.labels, loss_reduction="sum"))
            scored += _scored(trainer, b.labels)
            valid += int((b.labels != IGNORE).sum())
        trainer.model.train()
    assert 0 < scored < 0.9 * valid
    assert trainer.evaluate() == pytest.approx(total / scored, rel=1e-6)


def _no_labels(trainer, relabel):
    """The trainer's next step reads micro-batches whose labels `relabel` rewrites."""
    step_batches = trainer.sampler.step_batches

    def patched(step):
        out = []
        for batch, _ in step_batches(step):
            batch.labels = relabel(batch.labels)
            out.append((batch, int((batch.labels != IGNORE).sum())))
        return out

    trainer.sampler.step_batches = patched


@pytest.mark.parametrize("kind", ["dense", "draft"])
def test_a_step_without_a_scored_label_is_not_applied(tmp_path, corpus, target, kind, monkeypatch):
    lines = []
    if kind == "dense":  # every label ignored: the trainer's own count is 0
        trainer = Trainer(load_config(None, [*QUIET, *corpus, "--model.layers=1", "--model.dim=32",
                                             "--model.ffn_dim=64", "--train.steps=3",
                                             f"--train.run_dir={tmp_path}"]), log=lines.append, read_ahead=False)
        _no_labels(trainer, lambda labels: torch.full_like(labels, IGNORE))
    else:  # every label outside the draft's vocabulary: the batch has valid labels, none the draft scores
        trainer = _draft(tmp_path, corpus, target)
        ids = set(trainer.model.draft.vocab.ids.tolist())
        outside = next(t for t in range(trainer.cfg.model.vocab_size) if t not in ids)
        _no_labels(trainer, lambda labels: torch.where(labels == IGNORE, labels, torch.full_like(labels, outside)))
    seen = _recording(monkeypatch)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    loss, grad_norm, _ = trainer.step(1)
    assert torch.isnan(loss) and torch.isfinite(grad_norm)
    assert not seen["apply"]
    for p, b in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    if kind == "dense":  # (known on the host: said; a draft's count stays on the device)
        assert any("every label of its global batch is ignored" in str(x) for x in lines)
