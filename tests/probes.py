"""Test probes and small fixtures shared by several test files."""

import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any op outputs (among those `keep` accepts):
    shows that a chunked computation never materialises the whole thing."""

    def __init__(self, keep=lambda t: True):
        super().__init__()
        self.largest, self.keep = 0, keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and self.keep(t):
                self.largest = max(self.largest, t.numel())
        return out


def packed_batch(cfg, seq=64, batch=2, seed=0):
    """tokens, positions, document ids, labels: three documents per row (positions restarting at
    each), every ninth label ignored."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels[:, ::9] = -100
    doc = torch.zeros(batch, seq, dtype=torch.long)
    doc[:, seq // 3:] = 1
    doc[:, 2 * seq // 3:] = 2
    pos = torch.arange(seq).expand(batch, seq) - torch.tensor([0, seq // 3, 2 * seq // 3])[doc]
    return tokens, pos, doc, labels


def loss_and_grads(model, batch):
    """One forward + backward: (loss, {parameter name: gradient})."""
    model.zero_grad(set_to_none=True)
    loss = model(*batch[:3], labels=batch[3])
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_run(layers=3, seed=1):
    """A small eager model, a packed batch and its (loss, gradients): what a wrapped or compiled copy
    of the model is compared against. Returns (model config, model, batch, (loss, grads))."""
    from longctx.config import load_config
    from longctx.models.llama import build_model

    cfg = load_config(overrides=[f"--model.layers={layers}"]).model
    model = build_model(cfg, seed=seed)
    batch = packed_batch(cfg)
    return cfg, model, batch, loss_and_grads(model, batch)


def metrics_losses(run_dir: Path) -> dict[int, float]:
    """A run's training loss of each logged step, from its metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind", "train") == "train"}


# a draft run's quiet short settings, and a corpus of word salad beside a tiny target run trained on it
DRAFT_QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=64",
               "--train.global_batch=2", "--metrics.log_interval=1", "--train.warmup_steps=1"]


def tiny_target_run(base: Path) -> tuple[list[str], Path]:
    """(the corpus flags, the checkpoints directory) of a 2-layer target trained 1 step on 40 random documents."""
    import random

    from longctx.config import load_config
    from longctx.train.trainer import Trainer

    (base / "docs").mkdir()
    rng = random.Random(0)
    for i in range(40):
        (base / "docs" / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(["def", "return", "self"])
                                                                for _ in range(rng.randint(3, 30))) + "\n")
    corpus = [f"--data.corpus={base / 'docs'}", "--data.tokenizer=byte"]
    cfg = load_config(None, [*DRAFT_QUIET, *corpus, "--model.layers=2", "--model.dim=64", "--model.ffn_dim=128",
                             "--train.steps=1", f"--train.run_dir={base / 't'}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return corpus, base / "t" / "checkpoints"
