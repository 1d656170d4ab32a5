"""Randomized audit of train.dtype = bf16 (bf16 autocast over fp32 weights, the CPU's and one GPU's way) against
float64, beyond tests/unit/test_bf16_numerics_audit.py (one shape against transformers) and test_memory_fuzz116.py
(bf16 cases against bf16 without a policy, 1e-2).

Seeded cases draw a tiny Llama or MoE (vocab 512-3000, 128-512 tokens a row, grad_accum 1-4, a random memory
policy, chunked loss on or off, the device or host_optimizer tier, clipping, token or sequence weighting) and run
two optimizer steps through train/step_run.py run_step. Bounds come from the unit roundoffs, u = 2^-8 (bf16) and
e = 2^-24 (fp32), and the size of each operation:

- against float64 (tests/memory_fuzz_reference.py: the plain model in float64, attention and cross-entropy written
  there): each bf16 rounding moves a value by at most u relative, and a forward path holds R = 8 per layer (the
  normed input's cast; q/k/v, attention, wo, w1/w3, the SwiGLU product, w2 outputs) + 2 (the head's input and its
  logits). To first order the logits move by at most R u |z|max, so a token's cross-entropy (d/dz has l1 norm <= 2)
  by 2 R u |z|max; a gradient takes R more roundings in backward: 2 R u of the gradients' norm;
- what the docs promise the bf16 forward's figures become, to fp32's accumulation bound: the reported loss is the
  fp32 sum of the forward's per-token losses (ops/loss.py: fp32 statistics; a sum of N terms in fp32 is within
  ~sqrt(N) e of exact for random rounding, bound used 8 sqrt(N) e sum|l|), accumulated over micro-batches in
  float64 (step_run.py); every gradient the optimizer sees is the fp32 sum of the micro-batches' gradients (within
  (k + 2) e sum_i |g_i| for k micro-batches and clipping's product), its norm that of the sum; AdamW's update is
  float64 AdamW's on those gradients within 16 e (|w| + lr) (about ten fp32 operations on terms <= lr, fp32 weights),
  which holds only with fp32 moments; params, gradients, moments and host masters are fp32.

A bf16 accumulation (of gradients, of the loss, of moments) errs by up to u = 2^16 e relative per rounding, far above
each fp32 bound here; and growth checks measure the error at two sizes (sequence length, accumulation count, the
number of log-sum-exp merges of chunked attention), where an accumulation in bf16 grows like N u rather than
staying at the bf16 rounding of one result. The float64 bounds are first-order worst cases (measured: the loss at
<= 0.2% of its bound, gradients at <= 25%); the fp32 ones are what catch a lost precision. Deliberate breaks in a
scratch copy of src, and what caught each (10 cases + 3 slow): gradients kept in bf16 between micro-batches: the
accumulation and norm checks (12 cases, the accumulation-count test); each token's loss cast to bf16 before the sum:
the loss-sum check (7 cases), both length and both vocabulary tests; AdamW moments in bf16: the AdamW check at step 2
(every case, 1,300-2,300x); host masters never refreshed: the AdamW check at step 1 (every host_optimizer case); the
log-sum-exp merge in bf16: the merge test (1.15 u); bf16 logits into the softmax statistics: 11 cases, the length
tests, the chunked vocabulary test; RMSNorm statistics in bf16: the norm test (1.90 u).
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

from longctx.data.samples import Batch
from longctx.job.runtime import Runtime
from longctx.models.llama import build_model
from longctx.ops.chunked import chunked_forward, local_grid
from longctx.parallel.context.shares import read_local_batch, to_device
from longctx.step.loss import forward_loss_sum, forward_token_losses
from longctx.step.optimizer import make_optimizer
from longctx.train.guard import StepGuard
from longctx.train.hooks import StepHooks
from longctx.train.model import build_llama_training, resolve_offload
from longctx.train.moe_hooks import moe_step_hooks
from longctx.train.step_progress import StepCounts
from longctx.train.step_run import run_step
from memory_fuzz_cases import case_config, make_case, micro_batches
from memory_fuzz_reference import dense_document_attention, float64_model, reference_step

pytestmark = pytest.mark.usefixtures("one_thread")

U, E = 2.0 ** -8, 2.0 ** -24  # unit roundoffs of bf16 and fp32
BF16 = torch.bfloat16
SEEDS = range(10)


def draw_case(seed: int, **override) -> dict:
    """A case of tests/memory_fuzz_cases.py's shape (its keys, its rules) at the sizes that make bf16 visible:
    larger vocabularies and rows, up to 4 micro-batches, no balancing losses or capacity (a routing flip between
    float64 and bf16 moves a token to another expert: not a precision fault)."""
    case = make_case(seed)
    rng = random.Random(117_000 + seed)
    seq = rng.choice([128, 256, 512])
    case.update(vocab=rng.choice([512, 1024, 2048, 3000]), seq=seq, rows=rng.randint(1, 2),
                grad_accum=rng.randint(1, 4), dim=rng.choice([32, 64]), ffn_dim=rng.choice([64, 96]),
                heads=4, kv_heads=rng.choice([2, 4]), head_dim=16, layers=2, bf16=True, capacity=0.0,
                aux_loss=0.0, z_loss=0.0, lr=1e-2, clip_ratio=rng.choice([0.0, 0.0, 0.5]),
                attention_chunk=rng.choice([0, 0, 32, 100]), block_chunk=rng.choice([0, 0, 64]),
                loss_chunk=rng.choice([0, 0, 64, 200]), model_states=rng.choice(["device", "host_optimizer"]),
                ignore=rng.choice([0.0, 0.3]), expert_chunk=rng.choice([0, 16, 64]) if case["moe"] else 0)
    case["offload_skip_last"] = min(case["offload_skip_last"], 1)  # (2 layers: the rules refuse 2 or more with offload)
    if case["recompute"] == "none":
        case["block_chunk"] = 0
    case["attention_offload"] = bool(case["attention_chunk"]) and case["attention_offload"]
    case.update(override)
    return case


class _Sampler:
    def __init__(self, rt, micros, weighting: str):
        self.rt, self.micros, self.weighting, self.last = rt, micros, weighting, None

    def batch(self, indices) -> Batch:
        m = self.micros[indices[0]]
        return Batch(m.tokens.clone(), m.labels.clone(), m.positions.clone(),
                     None if m.doc_ids is None else m.doc_ids.clone(), m.real.clone())

    def step_batches(self, step: int) -> list:
        self.last = [read_local_batch(self.rt, self, [i], self.weighting) for i in range(len(self.micros))]
        return self.last


def _trainer(cfg, model, rt):
    """What run_step reads of a Trainer, made of the Trainer's own parts (trainer.py _build)."""
    t = type("StepOwner", (), {})()
    t.cfg, t.model, t.rt, t.device, t.log = cfg, model, rt, torch.device("cpu"), lambda *a, **k: None
    t.optimizer = make_optimizer(model, cfg)
    t.hooks = StepHooks(moe_step_hooks(cfg, model, rt, t.log))
    t.guard = StepGuard(cfg.train.spike_factor, cfg.train.spike_window, t.device)
    t.device_section, t.co2, t.last_spike, t.step_counts = contextlib.nullcontext, None, None, StepCounts()
    t.autocast_dtype = BF16
    return t


def start_weights(case: dict) -> dict:
    """The case's random weights (every norm weight and bias too), as test_memory_fuzz116's plain_start."""
    model = build_model(case_config(case).model, seed=case["seed"])
    gen = torch.Generator().manual_seed(500 + case["seed"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.2 if p.dim() < 2 else 0.05))
    return model


def policy_model(cfg, state: dict):
    rt = Runtime.create(cfg, 0, 1, "cpu")
    cfg = resolve_offload(cfg, torch.device("cpu"), rt, log=lambda *a, **k: None)
    model = build_llama_training(cfg, torch.device("cpu"), rt, log=lambda *a, **k: None)
    model.load_state_dict(state)
    return cfg, model, rt


def _seen(model, optimizer) -> dict:
    """{name: (gradient, dtype)} the optimizer steps with: the weights' own or, under host_optimizer, its masters'."""
    masters = getattr(optimizer, "masters", None)
    grads = {id(p): p.grad for p in model.parameters()} if masters is None else \
        {id(p): m.grad for p, m in zip(optimizer.params, masters)}
    return {n: grads[id(p)].detach().clone() for n, p in model.named_parameters() if grads.get(id(p)) is not None}


def _states(model, optimizer) -> dict:
    """Each parameter's AdamW moments (the host's under host_optimizer: its inner optimizers')."""
    inner = getattr(optimizer, "_inner_state", None)
    index = {id(p): i for i, p in enumerate(getattr(optimizer, "params", []))}
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p) if inner is None else inner(index[id(p)]).get(optimizer.masters[index[id(p)]])
        if state:
            out[name] = {k: state[k] for k in ("exp_avg", "exp_avg_sq")}
    return out


def run_steps(cfg, state: dict, steps: list) -> dict:
    """Optimizer steps of the model a bf16 run builds, from `state`: per step the loss, norm, the gradients the
    optimizer took, the weights before and after, the micro-batches as the step read them, and the dtypes seen."""
    cfg, model, rt = policy_model(cfg, state)
    trainer = _trainer(cfg, model, rt)
    seen: dict = {}
    trainer.optimizer.register_step_pre_hook(lambda opt, a, k: seen.update(_seen(model, opt)))
    out = []
    for step, micros in enumerate(steps, start=1):
        trainer.sampler = _Sampler(rt, micros, cfg.train.loss_weighting)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen.clear()
        loss, norm, _ = run_step(trainer, step)
        getattr(trainer.optimizer, "finish_update", lambda: None)()
        masters = getattr(trainer.optimizer, "masters", [])
        dtypes = {("param", n): p.dtype for n, p in model.named_parameters()}
        dtypes.update({("grad", n): g.dtype for n, g in seen.items()})
        dtypes.update({("master", i): m.dtype for i, m in enumerate(masters)})
        dtypes.update({(k, n): t.dtype for n, s in _states(model, trainer.optimizer).items() for k, t in s.items()})
        out.append({"loss": loss, "norm": norm, "grads": dict(seen), "before": before, "dtypes": dtypes,
                    "after": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "batches": [(to_device(b, torch.device("cpu")), v) for b, v in trainer.sampler.last]})
    return out


def fp32_sums(cfg, state: dict, batches: list) -> dict:
    """The step's figures as the docs define them from the bf16 forward, summed here in float64: each micro-batch
    alone through the same model (its loss sum, the fp32 sum of its per-token losses, its gradient times
    1 / the step's labels), then the sums over micro-batches; `scale`: sum_i |g_i| per element."""
    _, model, _ = policy_model(cfg, state)
    weight = 1.0 / max(sum(v for _, v in batches), 1)  # (step_run.py forward_backward's, grad_scale 1 at world 1)
    out = {"loss": 0.0, "token_sum": 0.0, "token_abs": 0.0, "tokens": 0, "grads": {}, "scale": {}}
    for batch, _ in batches:
        model.zero_grad(set_to_none=True)
        loss_sum = forward_loss_sum(model, batch, BF16)
        (loss_sum * weight).backward()
        with torch.no_grad():
            each = forward_token_losses(model, batch, BF16).double()
        if batch.label_weights is not None:
            each = each * batch.label_weights.double()
        out["loss"] += float(loss_sum.detach()) * weight
        out["token_sum"] += float(each.sum()) * weight
        out["token_abs"] += float(each.abs().sum()) * weight
        out["tokens"] = max(out["tokens"], int((batch.labels != -100).sum()))
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.double()
                out["grads"][n] = out["grads"].get(n, 0) + g
                out["scale"][n] = out["scale"].get(n, 0) + g.abs()
    return out


def adamw_f64(before: dict, grads: list[dict], case: dict, betas=(0.9, 0.95), eps=1e-3) -> list[dict]:
    """The weights after each of len(grads) AdamW steps (decay on matrices only) in float64."""
    w = {n: p.double() for n, p in before.items()}
    m = {n: torch.zeros_like(p) for n, p in w.items()}
    v = {n: torch.zeros_like(p) for n, p in w.items()}
    out = []
    for t, g in enumerate(grads, start=1):
        for n in w:
            if n not in g:
                continue
            gn = g[n].double()
            m[n] = betas[0] * m[n] + (1 - betas[0]) * gn
            v[n] = betas[1] * v[n] + (1 - betas[1]) * gn * gn
            decay = case["weight_decay"] if w[n].dim() >= 2 else 0.0
            denom = (v[n] / (1 - betas[1] ** t)).sqrt() + eps
            w[n] = w[n] * (1 - case["lr"] * decay) - case["lr"] * (m[n] / (1 - betas[0] ** t)) / denom
        out.append(dict(w))
    return out


def roundings(case: dict) -> int:
    return 8 * case["layers"] + 2


def check_dtypes(run: dict, case: dict) -> None:
    bad = {k: d for k, d in run["dtypes"].items() if d != torch.float32}
    assert not bad, f"not fp32 (params, gradients, host masters, AdamW moments): {bad} in case {case}"
    assert run["loss"].dtype in (torch.float32, torch.float64) and run["norm"].dtype == torch.float32, \
        f"loss {run['loss'].dtype}, norm {run['norm'].dtype} in case {case}"
    assert any(k[0] == "exp_avg" for k in run["dtypes"]), f"no AdamW state to check in case {case}"


def check_against_float64(run: dict, ref: dict, zmax: float, case: dict) -> None:
    """The bf16 step's loss and gradients within the first-order bounds of the module docstring."""
    r = roundings(case)
    loss_err = abs(float(run["loss"]) - float(ref["loss"]))
    assert loss_err <= 2 * r * U * zmax, \
        f"loss {float(run['loss']):.6f} vs float64 {float(ref['loss']):.6f}: {loss_err:.2e} > 2 R u |z|max " \
        f"= {2 * r * U * zmax:.2e} in case {case}"
    unclipped = run["unclipped"]
    diff = math.sqrt(sum(float((unclipped[n] - g).square().sum()) for n, g in ref["grads"].items() if n in unclipped))
    assert diff <= 2 * r * U * ref["norm"], \
        f"gradients {diff:.3e} from float64's (norm {ref['norm']:.3e}): over 2 R u in case {case}"


def check_fp32_accumulation(run: dict, sums: dict, case: dict) -> None:
    """The reported loss, gradients and norm: the fp32 accumulations of the bf16 forward's own values."""
    loss = float(run["loss"])
    assert abs(loss - sums["loss"]) <= 1e-12 * abs(loss) + 4 * E * abs(sums["loss"]), \
        f"the step's loss {loss!r} is not the float64 sum of its micro-batches' {sums['loss']!r} in case {case}"
    bound = 8 * math.sqrt(sums["tokens"]) * E * sums["token_abs"]
    assert abs(sums["loss"] - sums["token_sum"]) <= bound, \
        f"the loss sum {sums['loss']!r} is not the fp32 sum of its tokens' losses {sums['token_sum']!r} " \
        f"(bound {bound:.2e}) in case {case}"
    norm = math.sqrt(sum(float(g.square().sum()) for g in sums["grads"].values()))
    assert abs(float(run["norm"]) - norm) <= 1e-5 * norm, \
        f"reported gradient norm {float(run['norm'])!r} vs that of the summed gradients {norm!r} in case {case}"
    coef = min(1.0, case["max_norm"] / (float(run["norm"]) + 1e-6)) if case["max_norm"] > 0 else 1.0
    k = len(run["batches"])
    for n, want in sums["grads"].items():
        err = (run["grads"][n].double() - coef * want).abs()
        allowed = (k + 2) * E * coef * sums["scale"][n] + 1e-30
        worst = float((err / allowed).max())
        assert worst <= 1.0, \
            f"gradient of {n} is not the fp32 sum of {k} micro-batches' ({worst:.1f}x the bound) in case {case}"


def check_adamw(runs: list, case: dict) -> None:
    want = adamw_f64(runs[0]["before"], [r["grads"] for r in runs], case)
    for t, (run, w) in enumerate(zip(runs, want), start=1):
        for n, p in run["after"].items():
            err = (p.double() - w[n]).abs()
            allowed = 16 * E * (w[n].abs() + case["lr"])
            worst = float((err / allowed).max())
            assert worst <= 1.0, f"{n} after step {t}: {worst:.1f}x the fp32 AdamW bound in case {case}"


def audit(seed: int, **override) -> None:
    case = draw_case(seed, **override)
    plain = start_weights(case)
    steps = [micro_batches(case), micro_batches(case, draw=1)]
    ref = reference_step(float64_model(plain), steps[0], case)
    case["max_norm"] = round(case["clip_ratio"] * ref["norm"], 6)
    cfg = case_config(case, grad_clip=case["max_norm"])
    state = plain.state_dict()
    runs = run_steps(cfg, state, steps)
    sums = fp32_sums(cfg, state, runs[0]["batches"])
    for run in runs:
        check_dtypes(run, case)
    check_fp32_accumulation(runs[0], sums, case)
    runs[0]["unclipped"] = sums["grads"]
    with torch.no_grad():
        zmax = float(max(float64_model(plain)(m.tokens, m.positions, m.doc_ids).abs().max() for m in steps[0]))
    check_against_float64(runs[0], ref, zmax, case)
    check_adamw(runs, case)


@pytest.mark.parametrize("seed", SEEDS)
def test_bf16_step_matches_float64_and_fp32_accumulation(seed):
    audit(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [20, 21, 22])
def test_bf16_step_at_long_rows(seed):
    """The same audit at 2,048 and 4,096 tokens a row, over 2 micro-batches (20-60 s each on one core)."""
    audit(seed, seq=2048 * (1 + seed % 2), rows=1, grad_accum=2, attention_chunk=512 * (seed % 2), expert_chunk=0)


def _loss_errors(seed: int, seq: int, loss_chunk: int) -> tuple[float, float]:
    """One row of `seq` tokens (vocab 3000): the bf16 forward's summed loss relative to float64's, and its distance
    from the float64 sum of its own per-token losses in units of sqrt(N) e sum|l| (the fp32 sum's bound)."""
    case = draw_case(seed, seq=seq, rows=1, grad_accum=1, vocab=3000, moe=False, family="llama", ignore=0.0,
                     pad=False, doc_mask=False, weighting="token", loss_chunk=loss_chunk, recompute="none",
                     block_chunk=0, attention_chunk=0, attention_offload=False, offload_fraction=0.0)
    plain = start_weights(case)
    micro, = micro_batches(case)
    _, model, _ = policy_model(case_config(case), plain.state_dict())
    batch = Batch(micro.tokens, micro.labels, micro.positions, None, micro.real).to("cpu")
    with torch.no_grad():
        total = float(forward_loss_sum(model, batch, BF16))
        each = forward_token_losses(model, batch, BF16).double()
        want = float(float64_model(plain)(micro.tokens, micro.positions, None, labels=micro.labels,
                                          loss_reduction="sum"))
    fp32_units = abs(total - float(each.sum())) / (math.sqrt(each.numel()) * E * float(each.abs().sum()))
    return abs(total - want) / abs(want), fp32_units


@pytest.mark.parametrize("loss_chunk", [0, 256])
def test_loss_error_does_not_grow_with_sequence_length(loss_chunk):
    """The summed loss of 256 and of 2,048 tokens: the bf16 forward's per-token errors average out in the mean (its
    relative error at 8x the tokens stays below the shorter row's or 1/16 of a bf16 rounding, u/16: measured
    2e-5 to 6e-4 at 256 tokens, 2e-5 to 6e-5 at 2,048), and the sum over tokens is fp32's (within 8 sqrt(N) e of
    the exact sum of the same per-token losses). A bf16 sum of 2,048 losses near 8 loses whole units (its ulp at
    16,000 is 128): both grow with N."""
    for seed in range(2):
        short, short_fp32 = _loss_errors(seed, 256, loss_chunk)
        long, long_fp32 = _loss_errors(seed, 2048, loss_chunk)
        assert long <= max(short, U / 16), f"seed {seed}: loss error {short:.2e} at 256 tokens, {long:.2e} at 2048"
        assert max(short_fp32, long_fp32) <= 8, \
            f"seed {seed}: the loss sum is {short_fp32:.1f} / {long_fp32:.1f} sqrt(N) e from its tokens' exact sum"


def test_gradient_accumulation_error_grows_like_fp32():
    """The same 8 rows as 2 and as 8 micro-batches: each gradient the optimizer takes is the fp32 sum of the
    micro-batches' (within (k + 2) e sum|g_i|: measured 2.2 e at k = 8), whose bf16 accumulation would be up to
    u = 65,536 e away per add; and the summed gradient within the float64 bound at both counts."""
    for k in (2, 8):
        audit(3, seq=64, rows=8 // k, grad_accum=k, vocab=1024, moe=False, family="llama", clip_ratio=0.0,
              model_states="host_optimizer" if k == 8 else "device")


def test_log_sum_exp_merges_do_not_accumulate_bf16_roundings():
    """Chunked attention (ops/chunked.py; the ring merges with the same ops/attention.py merge_partials) over 2,048
    bf16 tokens against float64 attention of the same bf16 inputs, norm-wise: one call carries one bf16 rounding of
    its output (each element <= u, ~u / sqrt(3) norm-wise for uniform relative errors: measured 0.47 u); in chunks
    each partial output is rounded once more and the fp32 merge adds none, ~sqrt(2/3) u <= u whatever the number of
    merges (measured 0.59 u at 32 chunks), and 32 chunks no more than u/8 above 2 (measured +0.07 u). A bf16
    accumulator rounds at every merge: measured 1.13 u at 32 chunks, +0.6 u."""
    gen = torch.Generator().manual_seed(117)
    q, k, v = ((torch.randn(1, 2048, 4, 32, generator=gen) * s).to(BF16) for s in (1.5, 1.5, 1.0))
    ref = dense_document_attention(q.double(), k.double(), v.double(), None)
    errors = {}
    for chunk in (1024, 64):
        out, lse = chunked_forward(q, k, v, local_grid(1, 2048, None, chunk, True))
        assert out.dtype == BF16 and lse.dtype == torch.float32
        errors[chunk] = float((out.double() - ref).norm() / ref.norm())
    assert errors[64] <= U and errors[64] - errors[1024] <= U / 8, f"relative errors by chunk {errors} (u = {U})"


@pytest.mark.parametrize("chunk", [0, 96])
def test_loss_statistics_over_a_large_vocabulary_are_fp32(chunk):
    """lm_head_loss under bf16 autocast (vocab 3,000, 512 tokens, plain and chunked) against float64 cross-entropy
    of the same bf16 logits (the head's own matmul: F.linear of the bf16-cast operands): softmax statistics in fp32
    leave only fp32 roundings: the sum within 8 sqrt(N) e sum|l|, and each token's log-sum-exp, a sum of V terms
    whose relative error is its absolute one, within 8 sqrt(V) e, randomly signed over N tokens. bf16 statistics
    round each token's log-sum-exp (|lse| ~ 8) by up to u: measured 0.35 against a bound of 0.06 in the chunked
    path (the plain path's F.cross_entropy runs in fp32 under autocast whatever it is given)."""
    from longctx.ops.loss import lm_head_loss

    gen = torch.Generator().manual_seed(11)
    n, dim, vocab = 512, 64, 3000
    h, weight = torch.randn(n, dim, generator=gen), torch.randn(vocab, dim, generator=gen) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=gen)
    with torch.autocast("cpu", dtype=BF16):
        got = lm_head_loss(h, weight, labels, chunk=chunk, reduction="sum")
    logits = torch.nn.functional.linear(h.to(BF16), weight.to(BF16)).double()
    each = torch.logsumexp(logits, -1) - logits.gather(1, labels[:, None]).squeeze(1)
    bound = 8 * math.sqrt(n) * E * float(each.abs().sum()) + 8 * math.sqrt(n * vocab) * E
    assert got.dtype == torch.float32 and abs(float(got) - float(each.sum())) <= bound, \
        f"loss {float(got)!r} vs float64 {float(each.sum())!r} of the same logits (bound {bound:.2e})"


def test_norm_statistics_of_bf16_inputs_are_fp32():
    """rms_norm of bf16 rows (the q/k norms' inputs under autocast) of 4,096 values with an offset (mean square far
    from the spread): fp32 statistics leave one bf16 rounding of the normalized value (<= u relative: measured
    0.99 u) and fp32's (the mean of 4,096 squares, the rsqrt, the weight's product: 64 e allowed); bf16 statistics
    round the squares, their mean and its rsqrt too (measured 1.9 u)."""
    from longctx.ops.norm import rms_norm

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 4096, generator=gen) * 0.5 + 3.0).to(BF16)
    weight = torch.rand(4096, generator=gen) + 0.5
    got = rms_norm(x, weight, 1e-6).double()
    xd = x.double()
    want = weight.double() * xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
    worst = float(((got - want).abs() / ((U + 64 * E) * want.abs())).max())
    assert worst <= 1.0, f"rms_norm of bf16 rows: {worst:.2f}x one bf16 rounding of its output"
