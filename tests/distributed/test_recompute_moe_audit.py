"""Recomputation meets routing state: a recomputed MoE forward (memory.recompute selective / full,
memory.block_chunk, memory.offload_fraction) must route exactly as the first forward did, read the
same step-dependent schedule, and leave the router statistics of the step as one forward leaves
them. The routers here hold what the other recompute tests leave out: DTS-Gate in the middle of its
schedule (k between top_k and E, temperature above 1: a schedule read at another step in backward
would weigh another set of experts), the sigmoid group-limited router with a nonzero selection bias
and a capacity, gated shared experts beside a top-1 capacity. References: the same model without a
memory policy (one forward, nothing recomputed) in one process; under expert parallelism 2 with
full recomputation in block chunks, the one-process run without recomputation."""

import copy
from pathlib import Path

import pytest
import torch

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.llama import build_model
from longctx.models.moe import moe_layers
from longctx.train.metrics import read_jsonl
from longctx.train.trainer import Trainer, train

TINY = ["--model.preset=debug-moe", "--model.layers=2", "--model.dim=64", "--model.moe.dense_layers="]
ROUTERS = {
    "dts-mid-schedule": {"router": "dts", "dts_steps": 10},  # at step 3: 6 of 8 experts, temperature 1.7
    "sigmoid-biased-capacity": {"router": "sigmoid", "groups": 2, "topk_groups": 1, "capacity_factor": 1.25},
    "shared-top1-capacity": {"top_k": 1, "capacity_factor": 1.0, "shared_dim": 64, "shared_gate": "true"},
}
# (recompute, offload fraction, block chunk) over 2 x 96 tokens
POLICIES = [("selective", 0.0, 0), ("full", 0.0, 0), ("selective", 0.0, 48), ("full", 0.0, 48),
            ("selective", 0.5, 0), ("full", 0.5, 40), ("selective", 0.3, 40)]


def _model(moe: dict):
    cfg = load_config(overrides=[*TINY, *(f"--model.moe.{k}={v}" for k, v in moe.items())]).model
    model = build_model(cfg, seed=0).train()
    model.set_router_step(3)
    g = torch.Generator().manual_seed(2)
    for layer in moe_layers(model):  # a bias that moves choices (the sigmoid router's: every layer's counts change)
        layer.router.expert_bias.copy_(0.05 * torch.randn(layer.num_experts, generator=g))
    return model


def _run(model):
    tokens = torch.randint(0, 320, (2, 97), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    terms = model.router_terms()
    (loss + terms.loss).backward()
    return loss.detach(), terms, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module", params=list(ROUTERS))
def reference(request):
    model = _model(ROUTERS[request.param])
    return request.param, model, _run(copy.deepcopy(model))


@pytest.mark.parametrize("policy,fraction,chunk", POLICIES)
def test_recomputed_forward_routes_as_the_first(reference, policy, fraction, chunk):
    name, base, (loss0, terms0, grads0) = reference
    model = copy.deepcopy(base)
    apply_memory_policy(model.layers, policy, fraction, offload_skip_last=1, block_chunk=chunk)
    loss1, terms1, grads1 = _run(model)
    if name == "dts-mid-schedule":
        assert moe_layers(model)[0].router.routing() == (pytest.approx(1.7), 6)  # (mid-schedule, not advanced)
    if "capacity" in name:
        assert terms0.dropped.sum() > 0  # (the capacity binds)
    assert torch.equal(terms1.counts, terms0.counts), name  # the same choices, counted once
    assert torch.equal(terms1.dropped, terms0.dropped), name
    torch.testing.assert_close(terms1.stats, terms0.stats, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    assert grads0.keys() == grads1.keys()
    for key in grads0:  # chunks sum in another order: within fp32 rounding of the largest entry
        assert (grads1[key] - grads0[key]).abs().max() <= 2e-6 * grads0[key].abs().max(), key
    for a, b in zip(moe_layers(model), moe_layers(base)):  # nothing the forward or its recomputation moves
        assert a.router.step == 3 and torch.equal(a.router.expert_bias, b.router.expert_bias)
        assert not a.records and not a.recording


TRAIN = [*TINY, "--train.grad_accum=2", "--train.global_batch=4", "--train.seq_len=64", "--train.steps=3",
         "--train.eval_interval=0", "--data.max_docs=50", "--metrics.plots=false", "--metrics.progress=false",
         "--metrics.log_interval=1", "--model.moe.router=sigmoid", "--model.moe.groups=2", "--model.moe.topk_groups=1",
         "--model.moe.capacity_factor=1.25", "--model.moe.bias_update_rate=0.01"]
FIGURES = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_load_mean", "moe_load_worst", "moe_drop_rate",
           "moe_layer_drop", "moe_layer_load", "moe_expert_load", "moe_bias_norm")


def _trained(policy: list[str], run_dir):
    cfg = load_config("configs/debug.toml", [*TRAIN, *policy, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    counts = []
    original = trainer.model.update_expert_bias
    trainer.model.update_expert_bias = lambda c: (counts.append(c.clone()), original(c))
    trainer.run()
    lines = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "moe_aux_loss" in r]
    return [{k: r.get(k) for k in FIGURES} for r in lines], counts


@pytest.mark.parametrize("policy", [["--memory.recompute=full", "--memory.block_chunk=48"],
                                    ["--memory.recompute=selective", "--memory.offload_fraction=0.5",
                                     "--memory.offload_skip_last=0", "--memory.block_chunk=40"]])
def test_trainer_steps_and_router_figures_equal_the_run_without_recomputation(tmp_path, policy):
    """3 steps of 2 micro-batches, the selection bias moving after each: every step's loss and metrics line
    (moe_* fields) and the counts the bias update reads equal the run that recomputes nothing."""
    ref, ref_counts = _trained([], tmp_path / "none")
    got, got_counts = _trained(policy, tmp_path / "recomputed")
    assert len(ref) == len(got) == 3
    for a, b in zip(ref, got):
        for key in FIGURES:
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
            else:
                assert b[key] == a[key], key
    assert len(ref_counts) == len(got_counts) == 3
    for c0, c1 in zip(ref_counts, got_counts):
        assert torch.equal(c0, c1)
        assert (c1.sum(1) == 4 * 64 * 2).all()  # every choice of the step's 4 x 64 tokens once (top-2), not twice


EP = [*TINY, "--train.global_batch=4", "--train.seq_len=128", "--train.steps=3", "--train.eval_interval=0",
      "--data.max_docs=100", "--metrics.plots=false", "--metrics.progress=false", "--train.warmup_steps=2",
      "--model.moe.capacity_factor=1.0"]


def _ep_train(args, run_dir):
    cfg = load_config("configs/debug.toml", [*EP, *args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


def test_expert_parallel_full_recompute_in_block_chunks_matches_one_process(tmp_path):
    """expert 2 (2 ranks, gloo), memory.recompute full + block_chunk (the chunks' capacity decided over the
    rank's call, gathered over the ranks, again in backward): the losses of one process without recomputation."""
    single = _ep_train([], str(tmp_path / "single"))
    runs = run_spawned_many(2, [("ep2", _ep_train, (["--parallel.expert=2", "--memory.recompute=full",
                                                    "--memory.block_chunk=48"], str(tmp_path / "ep2")))])
    assert len(single) == 3
    for rank_losses in runs["ep2"]:
        assert rank_losses == pytest.approx(single, rel=1e-6)  # (4.6e-8 measured)
