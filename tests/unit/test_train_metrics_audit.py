"""What `longctx train` logs (train/metrics.py, models/flops.py, costs/peaks.py) and `longctx report`
draws (train/report.py), each against an independent count:

- model FLOPs per token: torch's FlopCounterMode on the real model's forward (every matmul a token goes
  through: GQA projections, SwiGLU, LM head, tied or not, a MoE layer's router, top_k experts, shared
  experts and their gate), the attention term against the causal pairs counted by hand, and the
  training figure against the PaLM / Megatron formula 6 N + 12 L s (heads x head_dim) (no causal halving);
  recomputation left out of it (model FLOPs), and the planner's timing (costs/timing.py) on the same count.
  (Document masks are not subtracted: the attention term stays the causal one, a documented convention
  shared with the planner and `bench train`, models/flops.py and planner/cost.py);
- a step's logged loss and gradient norm against a float64 re-computation of step 1 from the initial
  weights (token mean over every micro-batch; the norm before clipping), the logged lr against the
  schedule computed by hand and the one the optimizer held, the eval loss against a token mean over every
  eval token, tokens/s, TFLOP/s and MFU against the hand FLOP count and the interval's clock;
- the peak: a GPU run in fp32 is divided by the fp32 peak, not bf16's (it read its MFU 15x low);
- the report's loss and throughput plots: the newest record of a step (a rollback's re-run).
"""

import copy
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from longctx.config import load_config
from longctx.models.flops import forward_matmul_flops_per_token, train_flops_per_token
from longctx.models.llama import build_model
from longctx.ops.grouped import use_loop
from longctx.train import metrics as metrics_mod
from longctx.train import step_run
from longctx.train import trainer as trainer_mod
from longctx.train.metrics import MetricsLogger, read_jsonl

# ----------------------------------------------------------------------------------------------
# FLOPs per token


def _counted_matmul_flops_per_token(overrides: list[str], s: int = 32, b: int = 2) -> tuple[float, object]:
    """FlopCounterMode's count of one forward's matmuls per token; the attention core is replaced by an
    identity (its scores are checked on their own), the experts run as a loop of counted mm's."""
    cfg = load_config(overrides=["--model.preset=debug", *overrides]).model
    model = build_model(cfg)
    for layer in model.layers:
        layer.attention.core = lambda q, k, v, doc_ids: q
    tokens = torch.randint(0, cfg.vocab_size, (b, s))
    with torch.no_grad(), use_loop(), FlopCounterMode(display=False) as counter:
        model(tokens)
    return counter.get_total_flops() / (b * s), cfg


@pytest.mark.parametrize("overrides", [
    [],                                                                                  # GQA 4 / 2 heads
    ["--model.head_dim=48", "--model.kv_heads=1", "--model.tie_embeddings=true"],          # MQA, wide heads, tied
    ["--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.shared_experts=1", "--model.moe.shared_gate=true",
     "--model.moe.dense_layers=0", "--model.moe.expert_dim=96"],                          # MoE + shared + dense layer
    ["--model.moe.experts=8", "--model.moe.top_k=3", "--model.moe.shared_experts=2", "--model.moe.router=sigmoid",
     "--model.moe.groups=2", "--model.moe.topk_groups=1"],
])
def test_matmul_flops_per_token_match_torch_flop_counter(overrides):
    counted, cfg = _counted_matmul_flops_per_token(overrides)
    assert forward_matmul_flops_per_token(cfg) == pytest.approx(counted, rel=1e-12)
    # and not the MoE layer's every expert (what memory counts)
    if cfg.is_moe:
        assert counted < 2 * sum(p.numel() for p in build_model(cfg).parameters())


@pytest.mark.parametrize("s", [64, 1024, 131072])
def test_attention_term_is_the_causal_pairs(s):
    """Per layer and sequence: QK^T and PV are 2 x head_dim FLOPs each per (query, key) pair and head; a causal
    mask keeps s(s+1)/2 pairs. The code's 4 s d_attn x 1/2 per token is that up to 1/(s+1)."""
    cfg = load_config(overrides=["--model.preset=debug"]).model
    d_attn = cfg.heads * cfg.resolved_head_dim
    pairs = s * (s + 1) / 2
    hand = 3 * cfg.layers * 4 * d_attn * pairs / s  # forward + backward, per token
    code = train_flops_per_token(cfg, s) - 3 * forward_matmul_flops_per_token(cfg)
    assert code == pytest.approx(hand, rel=1.01 / (s + 1))
    full = train_flops_per_token(cfg, s, causal=False) - 3 * forward_matmul_flops_per_token(cfg)
    assert full == pytest.approx(2 * code)  # without the mask: every s^2 pair


@pytest.mark.parametrize("preset,s", [("debug", 512), ("llama3-8b", 8192), ("llama3-8b", 131072)])
def test_training_flops_against_the_palm_formula(preset, s):
    """PaLM (appendix B) / Megatron: 6 N + 12 L s H Q per token, N the non-embedding matmul parameters plus the LM
    head, attention counted over all s^2 pairs; longctx halves that attention term under the causal mask, so
    the two differ by exactly 6 L s H Q (at llama3-8b, 8K: 3.5% of 6N; at 128K: 57%)."""
    cfg = load_config(overrides=[f"--model.preset={preset}"]).model
    model = build_model(cfg, device="meta", seed=None)
    n = sum(p.numel() for name, p in model.named_parameters()
            if p.dim() == 2 and "tok_embeddings" not in name) + (cfg.dim * cfg.vocab_size if cfg.tie_embeddings else 0)
    hq = cfg.heads * cfg.resolved_head_dim
    palm = 6 * n + 12 * cfg.layers * s * hq
    assert train_flops_per_token(cfg, s, causal=False) == pytest.approx(palm, rel=1e-12)
    assert palm - train_flops_per_token(cfg, s) == pytest.approx(6 * cfg.layers * s * hq, rel=1e-9)


# ----------------------------------------------------------------------------------------------
# One tiny run: loss, gradient norm, lr, eval loss, tokens/s and MFU of the records

STEPS, GB, SEQ, WARMUP, LR, MIN_RATIO, CLIP, PEAK_TF = 4, 4, 64, 1, 3e-3, 0.1, 0.05, 1.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audit_run")
    corpus = tmp_path_factory.mktemp("audit_corpus")  # documents of uneven lengths, packed with padding (bfd):
    rng = random.Random(0)  # micro-batches and eval batches with different label counts
    for i in range(120):
        words = [rng.choice(("def", "return", "class", "x", "self", "import")) for _ in range(rng.randint(3, 30))]
        (corpus / f"doc{i}.txt").write_text(" ".join(words) + "\n")
    cfg = load_config(overrides=[
        f"--data.corpus={corpus}", "--data.strategy=bfd", "--data.dedup=none", "--data.eval_fraction=0.2",
        f"--train.run_dir={tmp}", f"--train.steps={STEPS}", f"--train.seq_len={SEQ}", f"--train.global_batch={GB}",
        "--train.grad_accum=2", f"--train.warmup_steps={WARMUP}", f"--train.lr={LR}",
        f"--train.min_lr_ratio={MIN_RATIO}", f"--train.grad_clip={CLIP}", f"--train.eval_interval={STEPS}",
        "--train.eval_batches=2", "--metrics.log_interval=1", "--metrics.progress=false", "--metrics.plots=false",
        f"--metrics.peak_tflops={PEAK_TF}", "--model.layers=1", "--train.device=cpu", "--checkpoint.final=false"])
    batches, lrs = [], []
    real_loss_sum, real_step = step_run.forward_loss_sum, step_run.guarded_step

    def loss_sum(model, batch, dtype):
        if model.training:
            batches.append(copy.deepcopy(batch))
        return real_loss_sum(model, batch, dtype)

    def step(optimizer, apply):
        lrs.append(optimizer.param_groups[0]["lr"])
        return real_step(optimizer, apply)

    mp = pytest.MonkeyPatch()
    mp.setattr(step_run, "forward_loss_sum", loss_sum)
    mp.setattr(step_run, "guarded_step", step)
    try:
        trainer = trainer_mod.Trainer(cfg, log=lambda *a, **k: None)
        initial = copy.deepcopy(trainer.model.state_dict())
        result = trainer.run()
    finally:
        mp.undo()
    return SimpleNamespace(cfg=cfg, trainer=trainer, initial=initial, result=result, batches=batches, lrs=lrs,
                           records=read_jsonl(tmp / "metrics.jsonl"))


def _loss_sums(model, batches) -> list[tuple[float, int]]:
    """(summed cross entropy in float64, labels) of each batch, from the logits."""
    out = []
    for b in batches:
        logits = model(b.tokens, b.positions, b.doc_ids).double()
        out.append((F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=-100, reduction="sum"),
                    int((b.labels != -100).sum())))
    return out


def test_step_loss_is_the_token_mean_and_grad_norm_is_before_clipping(run):
    model = build_model(run.cfg.model)
    model.load_state_dict(run.initial)
    micro = run.batches[:2]  # step 1's two micro-batches
    sums = _loss_sums(model, micro)
    labels = sum(n for _, n in sums)
    loss = sum(s for s, _ in sums) / labels
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))
    first = next(r for r in run.records if r["kind"] == "train" and r["step"] == 1)
    micro_means = sum(float(s.detach()) / n for s, n in sums) / len(sums)
    assert abs(micro_means - float(loss.detach())) > 1e-4  # (label counts differ: the two readings tell apart)
    assert first["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert first["grad_norm"] > 10 * CLIP  # (the norm before clipping, not the clipped CLIP)


def test_logged_lr_matches_the_schedule_and_the_optimizer(run):
    floor = LR * MIN_RATIO
    decay = STEPS - WARMUP - 1
    hand = [LR * (i + 1) / WARMUP if i < WARMUP else
            floor + 0.5 * (LR - floor) * (1 + math.cos(math.pi * (i - WARMUP) / decay)) for i in range(STEPS)]
    logged = [r["lr"] for r in run.records if r["kind"] == "train"]
    assert [r["step"] for r in run.records if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert logged == pytest.approx(hand, rel=1e-12)
    assert run.lrs == pytest.approx(hand, rel=1e-12)
    assert logged[-1] == pytest.approx(floor)


class _UnevenEval:
    """The run's first train samples, the first two (the first micro-batch of an evaluation) with all but 5 of
    their labels ignored: micro-batches of very different label counts."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return 2 * GB

    def batch(self, indices):
        b = self.base.batch(indices)
        for row, i in enumerate(indices):
            if i < 2:
                keep = (b.labels[row] != -100).nonzero()[:5, 0]
                labels = torch.full_like(b.labels[row], -100)
                labels[keep] = b.labels[row][keep]
                b.labels[row] = labels
        return b


def test_eval_loss_is_a_token_mean_over_every_eval_token(run):
    """The recorded evaluation: every labelled token of the first eval_batches global batches (float64 reference)."""
    samples = run.trainer.eval_samples
    n = min(len(samples), 2 * GB) // GB * GB
    with torch.no_grad():
        sums = _loss_sums(run.trainer.model, [samples.batch([i]) for i in range(n)])
    (record,) = [r for r in run.records if r["kind"] == "eval"]
    assert record["step"] == STEPS
    assert record["loss"] == pytest.approx(float(sum(s for s, _ in sums)) / sum(c for _, c in sums), rel=1e-5)


def test_evaluation_weighs_micro_batches_by_their_labels(run):
    uneven = _UnevenEval(run.trainer.sampler.train_samples)
    with torch.no_grad():
        sums = _loss_sums(run.trainer.model, [uneven.batch([i]) for i in range(len(uneven))])
    token_mean = float(sum(s for s, _ in sums)) / sum(c for _, c in sums)
    micro = run.trainer.micro_step_sequences
    micro_means = [float(sum(s for s, _ in sums[i:i + micro])) / sum(c for _, c in sums[i:i + micro])
                   for i in range(0, len(sums), micro)]
    assert abs(sum(micro_means) / len(micro_means) - token_mean) > 1e-2  # (the two readings differ here)
    run.trainer.sampler.eval_samples, before = uneven, run.trainer.sampler.eval_samples
    try:
        assert run.trainer.evaluate() == pytest.approx(token_mean, rel=1e-5)
    finally:
        run.trainer.sampler.eval_samples = before


def test_tokens_tflops_and_mfu_of_every_record(run):
    m = run.cfg.model
    hd = m.resolved_head_dim
    matmul = m.layers * (m.dim * (m.heads + 2 * m.kv_heads) * hd + m.heads * hd * m.dim + 3 * m.dim * m.ffn_dim)
    hand = 3 * (2 * matmul + 2 * m.dim * m.vocab_size + m.layers * 2 * SEQ * m.heads * hd)  # causal-halved 4 s d
    for r in (r for r in run.records if r["kind"] == "train"):
        assert r["tokens"] == r["step"] * GB * SEQ  # every sequence of the global step, any grad_accum
        assert r["tflops"] * 1e12 / r["tokens_per_s"] == pytest.approx(hand, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tflops"] / PEAK_TF, rel=1e-9)  # world 1 x the peak
        assert r["world"] == 1


def test_recomputation_is_not_model_flops(run, tmp_path):
    """memory.recompute = full runs every block's forward again in backward: hardware FLOPs, not model FLOPs. MFU
    (what the records report; no HFU is reported) counts the same FLOPs per token as without it."""
    overrides = [f"--train.run_dir={tmp_path}", "--memory.recompute=full", "--train.steps=1", "--train.eval_interval=0"]
    records = read_jsonl(_train_once(run.cfg, overrides) / "metrics.jsonl")
    (r,) = [r for r in records if r["kind"] == "train"]
    (first,) = [r for r in run.records if r["kind"] == "train" and r["step"] == 1]
    assert r["tflops"] / r["tokens_per_s"] == pytest.approx(first["tflops"] / first["tokens_per_s"], rel=1e-9)


def _train_once(cfg, overrides):
    from longctx.config.load import to_toml

    path = Path(overrides[0].split("=", 1)[1])
    path.mkdir(parents=True, exist_ok=True)
    (path / "base.toml").write_text(to_toml(cfg))
    trainer_mod.train(load_config(path / "base.toml", overrides=overrides), log=lambda *a, **k: None)
    return path


def test_planner_timing_counts_the_flops_the_metrics_count():
    """costs/timing.py's forward GEMM + causal attention FLOPs of a micro-batch, x3, are the metrics' model
    FLOPs of its tokens (the planner's predicted MFU and the trained one share a numerator)."""
    from longctx.costs.timing import causal_attention_flops, forward_gemm_flops

    for preset, s in (("debug", 512), ("llama3-8b", 32768)):
        m = load_config(overrides=[f"--model.preset={preset}"]).model
        tokens = 2 * s
        planner = 3 * (forward_gemm_flops(m, tokens) + causal_attention_flops(m, tokens, s))
        assert planner == pytest.approx(tokens * train_flops_per_token(m, s), rel=1e-12)


def test_the_interval_clock_counts_its_steps_and_leaves_out_evaluation(monkeypatch):
    """tokens/s = the interval's tokens / (its time - evaluation), over world x peak for MFU (a fake clock)."""
    clock = [0.0]
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: clock[0])
    rt = SimpleNamespace(world=2, is_main=False, comm_bytes=lambda: [], max=lambda xs: list(xs))
    said = []
    log = MetricsLogger.__new__(MetricsLogger)
    log.cfg = SimpleNamespace(metrics=SimpleNamespace(log_interval=10), train=SimpleNamespace(steps=100))
    log.rt, log.device, log.say, log.writer = rt, torch.device("cpu"), said.append, None
    log.peak, log.peak_calibrated, log.fsdp_bytes, log.grad_timers = 1e9, False, {}, []
    log.flops_per_token = 50.0
    log.interval = log._new_interval()
    clock[0] = 7.0  # (set-up time, before the loop opens)
    log.interval = log._new_interval()
    for _ in range(3):
        log.stepped(1000)
    clock[0] = 9.0
    log.evaluated(3, 2.0, 1.5, [])
    clock[0] = 11.0
    records = []
    log.writer = SimpleNamespace(write=records.append)
    log.line(3, 1.0, 1.0, 1e-3, {})
    (r,) = records
    assert r["tokens_per_s"] == pytest.approx(3000 / (4.0 - 1.5))
    assert r["tflops"] == pytest.approx(3000 * 50 / 2.5 / 1e12)
    assert r["mfu"] == pytest.approx(3000 * 50 / 2.5 / (2 * 1e9))


# ----------------------------------------------------------------------------------------------
# The peak MFU divides by


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype,precision,peak,kind", [
    ("bf16", "highest", 989e12, "bf16"),
    ("fp32", "highest", 67e12, "fp32"),     # CUDA cores: torch keeps TF32 off by default
    ("fp32", "high", 989e12 / 2, "TF32"),   # set_float32_matmul_precision("high"): TF32 tensor cores
])
def test_a_gpu_runs_mfu_is_against_the_peak_of_its_train_dtype(h100, monkeypatch, tmp_path, dtype, precision, peak,
                                                                 kind):
    """Vendor data sheet, H100 SXM dense: bf16 989 TFLOP/s, TF32 495, fp32 (CUDA cores) 67. A train.dtype = fp32
    run was divided by 989 whatever it computed in: its MFU read 15x low."""
    torch.set_float32_matmul_precision(precision)
    model = build_model(load_config(overrides=["--model.layers=1"]).model)
    rt = SimpleNamespace(world=1, is_main=True, broadcast=lambda x: x, comm_bytes=lambda: [], dims=None)
    for name, value in (("zero_pp_names", []), ("node_size", 0), ("hpz_group", 0), ("fsdp_bytes_per_step", {})):
        monkeypatch.setattr(metrics_mod, name, lambda *a, value=value, **k: value)  # (no mesh in this test)
    cfg = load_config(overrides=[f"--train.dtype={dtype}", f"--train.run_dir={tmp_path}"])
    logger = MetricsLogger(cfg, rt, torch.device("cuda", 0), model, tmp_path)
    assert logger.peak == pytest.approx(peak) and kind in logger.peak_source
    cfg = load_config(overrides=[f"--train.dtype={dtype}", f"--train.run_dir={tmp_path}", "--metrics.peak_tflops=12.5"])
    assert MetricsLogger(cfg, rt, torch.device("cuda", 0), model, tmp_path).peak == 12.5e12  # the override wins


# ----------------------------------------------------------------------------------------------
# `longctx report`


def test_report_draws_the_newest_record_of_each_step(tmp_path, monkeypatch):
    import json

    from matplotlib.figure import Figure

    from longctx.train.report import write_plots

    saved, original = {}, Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda self, path, *a, **k: saved.__setitem__(str(path).rsplit("/", 1)[-1], self)
                        or original(self, path, *a, **k))
    base = {"kind": "train", "grad_norm": 1.0, "lr": 1e-3, "tflops": 1.0, "mfu": 0.1, "memory_gib": 1.0}
    rows = [{**base, "step": 1, "loss": 5.0, "tokens_per_s": 100.0},
            {**base, "step": 2, "loss": 4.0, "tokens_per_s": 100.0},
            {"kind": "eval", "step": 2, "loss": 4.5},
            {**base, "step": 3, "loss": float("nan"), "tokens_per_s": 100.0},
            # rolled back to step 2: steps 3 and its eval again
            {"kind": "eval", "step": 2, "loss": 4.4},
            {**base, "step": 3, "loss": 3.5, "tokens_per_s": 120.0},
            {**base, "step": 4, "loss": 3.0, "tokens_per_s": 110.0}]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_plots(run)
    loss_ax = saved["loss.png"].axes[0]
    train_line, eval_line = loss_ax.lines[0], next(ln for ln in loss_ax.lines if "eval" in ln.get_label())
    assert list(train_line.get_xdata()) == [1, 2, 3, 4] and list(train_line.get_ydata()) == [5.0, 4.0, 3.5, 3.0]
    assert list(eval_line.get_ydata()) == [4.4]
    tput = saved["throughput.png"].axes[0].lines[0]
    assert list(tput.get_ydata()) == [100.0, 100.0, 120.0, 110.0]

