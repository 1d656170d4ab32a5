"""One optimizer step's GRADIENT (not only its loss) against single-device autograd over the whole global batch,
on rows of very unequal trained-token counts (instruction-style label masks: one row fully trained, some with a
few labels, some with none), so that a per-micro-batch or per-rank mean would show: under grad accumulation,
data parallelism with a rank whose micro-batch has no label, context / head parallelism with a rank holding no
label of a row (the labels in the row's first quarter, zigzag), the chunked loss, FSDP's sync per micro-batch,
and train.loss_weighting = sequence (each packed document's mean, averaged over the step's documents). The
evaluation's loss over the same rows is their token mean under every layout and grad_accum too.

The parity tests (test_training_parity.py) compare per-step losses, where AdamW's first update is nearly
sign(gradient): a gradient scaled per micro-batch or per rank barely moves them. Here the gradients are compared
before the update (train.grad_clip = 0), each relative to its tensor's largest entry."""

import random

import pytest
import torch

from longctx.job.spawn import run_spawned_many

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, VOCAB, ROWS = 128, 300, 8
# each row's labelled spans (label positions); rows 2 and 5 have none, row 3 only in its first quarter
SPANS = [[(0, 127)], [(100, 110)], [], [(2, 20)], [(40, 127)], [], [(0, 5), (90, 100)], [(10, 30)]]


def _rows():
    """ROWS rows [SEQ] of two packed documents each: (tokens, labels, positions, doc_ids)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for spans in SPANS:
        tokens = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = torch.full((SEQ,), -100)
        for s, e in spans:
            labels[s:e] = tokens[s + 1:e + 1]
        doc = (torch.arange(SEQ) >= SEQ // 2).long()
        labels[SEQ // 2 - 1] = -100  # (no label across the documents)
        out.append((tokens, labels, torch.arange(SEQ) - SEQ // 2 * doc, doc))
    return out


class _Rows:
    """A test's sample set, read whole (read_local_batch cuts it for each rank)."""
    reads_by_position = False

    def __init__(self):
        self.data = _rows()

    def __len__(self):
        return len(self.data)

    def batch(self, indices):
        from longctx.data.samples import Batch

        rows = [self.data[i] for i in indices]
        return Batch(*(torch.stack([r[j] for r in rows]) for j in range(4)),
                     real=torch.ones(len(rows), SEQ, dtype=torch.bool))


def _args(run_dir, corpus, extra):
    return [f"--data.corpus={corpus}", "--data.max_docs=0", f"--train.seq_len={SEQ}", f"--train.global_batch={ROWS}",
            "--train.steps=1", "--train.warmup_steps=0", "--train.grad_clip=0", "--train.eval_interval=0",
            "--train.eval_batches=1", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
            "--model.layers=2", "--checkpoint.final=false", "--train.dtype=fp32", f"--train.run_dir={run_dir}", *extra]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(run_dir, corpus, extra, weighting):
    """On each rank: the starting weights, step 1's gradients (before the update), its loss, and the evaluation's
    loss over the same rows."""
    import longctx.train.trainer as trainer_module
    from longctx.config import load_config
    from longctx.parallel.context.shares import read_local_batch

    cfg = load_config(None, _args(run_dir, corpus, [*extra, f"--train.loss_weighting={weighting}"]))
    trainer = trainer_module.Trainer(cfg, log=lambda *a, **k: None)
    samples, micro = _Rows(), ROWS // cfg.train.grad_accum
    draws = [list(range(i * micro, (i + 1) * micro)) for i in range(cfg.train.grad_accum)]
    trainer.sampler.step_batches = lambda step: [read_local_batch(trainer.rt, samples, d, weighting) for d in draws]
    start = {n: _full(p.detach()).clone() for n, p in trainer.model.named_parameters()}
    trainer.sampler.eval_samples = samples
    eval_loss = trainer.evaluate()
    grads, loss = _first_step_grads(trainer)
    return start, grads, loss, eval_loss



def _first_step_grads(trainer):
    """Step 1's loss and its gradients as the optimizer receives them (before the update), full tensors."""
    import longctx.train.step_run as step_run  # (the step's update: train/step_run.py)

    grads, step = {}, step_run.guarded_step

    def capture(optimizer, apply):
        grads.update({n: _full(p.grad).clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(optimizer, apply)

    step_run.guarded_step = capture
    try:
        loss = float(trainer.step(1)[0])
    finally:
        step_run.guarded_step = step
    return grads, loss

def _reference(start, corpus, tmp, weighting):
    """Autograd on one device over every row: the mean over all trained labels, or over the documents of
    their own means (train.loss_weighting = sequence); and the token mean without gradient (the evaluation's)."""
    from longctx.config import load_config
    from longctx.models.llama import build_model

    model = build_model(load_config(None, _args(tmp, corpus, [])).model)
    model.load_state_dict(start)
    total, count, token_sum, tokens = 0.0, 0, 0.0, 0
    for tok, labels, pos, doc in _rows():
        for d in (0, 1):
            lab = torch.where(doc == d, labels, -100)
            n = int((lab != -100).sum())
            if n:
                s = model(tok[None], pos[None], doc[None], labels=lab[None], loss_reduction="sum")
                token_sum, tokens = token_sum + s.detach(), tokens + n
                total, count = (total + s, count + n) if weighting == "token" else (total + s / n, count + 1)
    loss = total / count
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, loss.item(), (token_sum / tokens).item()


LAYOUTS = {  # (world, args)
    "dp2 accum2": (2, ["--train.grad_accum=2"]),
    "dp2 accum4": (2, ["--train.grad_accum=4"]),  # (a rank's micro-batch of one row without a label)
    "dp2 accum2 chunked sync-each": (2, ["--train.grad_accum=2", "--memory.loss_chunk=16",
                                         "--memory.grad_sync=micro_batch"]),
    "ctx2 accum4 zigzag chunked": (2, ["--parallel.ctx=2", "--train.grad_accum=4", "--parallel.seq_balance=zigzag",
                                       "--memory.loss_chunk=16"]),
    "head2 accum2": (2, ["--parallel.head=2", "--train.grad_accum=2"]),
    "one accum8": (1, ["--train.grad_accum=8"]),
}
WEIGHTINGS = ("token", "sequence")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Plain text for the Trainer's own store (the step reads the rows above instead)."""
    d = tmp_path_factory.mktemp("lossnorm_docs")
    rng = random.Random(0)
    for i in range(60):
        (d / f"d{i}.txt").write_text(" ".join(rng.choice("ab cd ef gh".split()) for _ in range(40)) + "\n")
    return str(d)


@pytest.fixture(scope="module")
def results(tmp_path_factory, corpus):
    """{(layout, weighting): every rank's _step}: the 2-rank layouts in one spawned job."""
    tmp = tmp_path_factory.mktemp("lossnorm")
    cases = [(layout, w) for layout in LAYOUTS for w in WEIGHTINGS]
    jobs = [(f"{layout} {w}", _step, (str(tmp / f"{layout}-{w}".replace(" ", "-")), corpus, LAYOUTS[layout][1], w))
            for layout, w in cases if LAYOUTS[layout][0] == 2]
    spawned = run_spawned_many(2, jobs)
    return {(layout, w): spawned[f"{layout} {w}"] if LAYOUTS[layout][0] == 2 else
            [_step(str(tmp / f"{layout}-{w}".replace(" ", "-")), corpus, LAYOUTS[layout][1], w)]
            for layout, w in cases}


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_steps_gradient_is_the_full_batch_mean_under_unequal_trained_tokens(layout, weighting, results, corpus,
                                                                             tmp_path):
    ranks = results[(layout, weighting)]
    start, grads, loss, eval_loss = ranks[0]
    ref, ref_loss, ref_eval = _reference(start, corpus, str(tmp_path), weighting)
    worst = {n: ((grads[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref}
    name, err = max(worst.items(), key=lambda kv: kv[1])
    assert err < 1e-4, f"{layout} {weighting}: {name}'s gradient is {err:.2e} off the full batch's (relative)"
    assert abs(loss - ref_loss) < 1e-5, (loss, ref_loss)
    assert all(r[2] == loss for r in ranks)  # (one figure on every rank)
    # the evaluation: the token mean over the same rows (whatever the training loss's weighting)
    assert all(abs(r[3] - ref_eval) < 1e-5 for r in ranks), ([r[3] for r in ranks], ref_eval)


# ----------------------------------------------------------------------------------------------
# a GliDe draft with a reduced vocabulary (draft.loss = ce): the step divides by the labels it scores, counted on
# each rank's device and summed over the ranks (Trainer._label_count); tests/unit/test_draft_vocab_loss.py ties
# one process's step and evaluation to autograd, this ties 2 ranks' to one process's

DRAFT = ["--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=64", "--train.global_batch=4",
         "--train.warmup_steps=1", "--data.tokenizer=byte"]


def _draft_step(run_dir, corpus, target, extra):
    """Step 1's gradients and loss, and the evaluation before it, of a draft with a 12-token vocabulary."""
    import longctx.train.trainer as trainer_module
    from longctx.config import load_config

    cfg = load_config(None, [*DRAFT, f"--data.corpus={corpus}", f"--draft.target={target}", "--draft.layers=1",
                             "--draft.vocab=12", "--draft.loss=ce", "--train.grad_clip=0", "--train.steps=3",
                             "--train.grad_accum=2", "--train.eval_interval=100", "--data.eval_fraction=0.2",
                             "--train.eval_batches=2", f"--train.run_dir={run_dir}", *extra])
    trainer = trainer_module.Trainer(cfg, log=lambda *a, **k: None, read_ahead=False)
    eval_loss = trainer.evaluate()
    grads, loss = _first_step_grads(trainer)
    return grads, loss, eval_loss


@pytest.fixture(scope="module")
def draft_corpus(tmp_path_factory):
    """Keyword documents of some 25 distinct bytes: a 12-token vocabulary leaves many labels out."""
    d = tmp_path_factory.mktemp("draft_docs")
    rng = random.Random(0)
    words = "def return self import class yield lambda async await with try except finally".split()
    for i in range(120):
        (d / f"doc{i:04d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) + "\n")
    return str(d)


@pytest.fixture(scope="module")
def draft_target(tmp_path_factory, draft_corpus):
    from longctx.config import load_config
    from longctx.train.trainer import Trainer

    run = tmp_path_factory.mktemp("draft-target")
    cfg = load_config(None, [*DRAFT, f"--data.corpus={draft_corpus}", "--model.layers=2", "--model.dim=64",
                             "--model.ffn_dim=128", "--train.steps=2", "--checkpoint.interval=2",
                             "--train.eval_interval=0", f"--train.run_dir={run}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return str(run / "checkpoints")


DRAFT_LAYOUTS = {"dp2": [], "ctx2": ["--parallel.ctx=2"]}


def test_a_reduced_vocabulary_drafts_step_and_evaluation_are_one_processs_under_ranks(tmp_path, draft_corpus,
                                                                                    draft_target):
    one = _draft_step(str(tmp_path / "one"), draft_corpus, draft_target, [])
    jobs = [(name, _draft_step, (str(tmp_path / name), draft_corpus, draft_target, extra))
            for name, extra in DRAFT_LAYOUTS.items()]
    for name, ranks in run_spawned_many(2, jobs).items():
        for grads, loss, eval_loss in ranks:
            assert set(grads) == set(one[0])
            worst = max(((grads[n] - one[0][n]).abs().max() / one[0][n].abs().max()).item() for n in grads)
            assert worst < 1e-4, (name, worst)
            assert abs(loss - one[1]) < 1e-5 and abs(eval_loss - one[2]) < 1e-5, (name, loss, one[1], eval_loss, one[2])
