"""Audit of how a run builds its model and optimizer: which parameters AdamW decays (step/optimizer.py), the
initial weights (models/llama.py init_weights, GliDe / Clover drafts), that a 2-rank FSDP / expert-parallel
build starts from and trains exactly like one process, and that model.init_from (a longctx checkpoint or
hf:DIR) overwrites every parameter and recomputes the RoPE frequencies for the run's scaling.

Each check is against a reference written here: parameter classes by module type, the documented stds,
a single-process build and AdamW run, the source model's tensors, RoPE's closed form."""

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from longctx.checkpoint.manager import CheckpointManager
from longctx.config import load_config, to_dict
from longctx.job.runtime import Runtime
from longctx.job.spawn import run_spawned_many
from longctx.models.clover import CloverDraft
from longctx.models.glide import GlideDraft
from longctx.models.llama import RMSNorm, build_model
from longctx.models.moe import moe_layers
from longctx.models.moe_experts import Experts
from longctx.step.optimizer import make_optimizer
from longctx.train.glide import CloverTraining, FrozenHead, GlideTraining
from longctx.train.model import build_llama_training

TINY = ["--model.dim=32", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2", "--model.vocab_size=64",
        "--model.ffn_dim=48", "--train.seq_len=16", "--train.global_batch=2", "--train.seed=5"]
MOE = ["--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.shared_experts=1"]
VARIANTS = {
    "llama": [],
    "tied": ["--model.tie_embeddings=true"],
    "attention_bias": ["--model.qkv_bias=true", "--model.out_bias=true"],
    "qwen2": ["--model.family=qwen2", "--model.qkv_bias=true"],
    "qwen3": ["--model.family=qwen3", "--model.qk_norm=true"],
    "qwen2_moe": ["--model.family=qwen2_moe", "--model.qkv_bias=true", *MOE, "--model.moe.shared_gate=true"],
}


def _cfg(*extra):
    return load_config(overrides=[*TINY, *extra])


def _quiet(*_a, **_k):
    pass


def _decays(model: nn.Module) -> dict[str, bool]:
    """The documented rule, by module type (not by tensor rank): every weight matrix (linear layers, the
    embedding, the LM head, the experts' stacked matrices, routers) is decayed; norms and biases are not."""
    out = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, RMSNorm) or p_name == "bias":
                out[name] = False
            elif isinstance(module, (nn.Linear, nn.Embedding, Experts)):
                out[name] = True
            else:
                raise AssertionError(f"{name}: a parameter of a kind this audit does not know ({type(module)})")
    return out


def _groups_by_name(model: nn.Module, optimizer) -> list[tuple[float, list[str]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in optimizer.param_groups]


# ------------------------------------------------------------------------------------------------
# weight decay groups and AdamW's settings


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_weight_decay_goes_to_exactly_the_matrices_each_parameter_once(variant):
    cfg = _cfg(*VARIANTS[variant])
    model = build_model(cfg.model, seed=0)
    frozen = "layers.0.attention.wq.weight"  # a frozen parameter belongs to no group
    model.get_parameter(frozen).requires_grad_(False)
    optimizer = make_optimizer(model, cfg)
    (decay, decayed), (no_decay, kept) = _groups_by_name(model, optimizer)
    assert (decay, no_decay) == (cfg.train.weight_decay, 0.0) and decay > 0
    want = _decays(model)
    assert sorted(decayed) == sorted(n for n, d in want.items() if d and n != frozen)
    assert sorted(kept) == sorted(n for n, d in want.items() if not d)
    assert len(decayed) + len(kept) == len(set(decayed) | set(kept)) == len(want) - 1
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not held & {id(b) for b in model.buffers()}  # inv_freq, expert_bias: never optimised
    if variant == "tied":  # the LM head is the embedding: one parameter, decayed once
        assert model.output is None and "tok_embeddings.weight" in decayed
    if variant == "qwen2_moe":
        assert {"layers.0.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2"} <= set(decayed)


@pytest.mark.parametrize(("states", "fused"), [("device", False), ("host", True)])
def test_adamw_takes_the_configs_hyper_parameters(states, fused):
    cfg = _cfg("--train.lr=0.004", "--train.beta1=0.85", "--train.beta2=0.97", "--train.eps=1e-7",
               "--train.weight_decay=0.05", f"--memory.model_states={states}")
    optimizer = make_optimizer(build_model(cfg.model, seed=0), cfg)
    assert isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        assert (group["lr"], group["betas"], group["eps"]) == (0.004, (0.85, 0.97), 1e-7)
        assert (bool(group["fused"]), bool(group["foreach"])) == (fused, not fused)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_a_drafts_optimizer_holds_its_parameters_only_never_the_targets(kind):
    cfg = _cfg(*VARIANTS["qwen2"])
    target = build_model(cfg.model, seed=1).requires_grad_(False)
    head = FrozenHead(target.tok_embeddings.weight.detach().clone(), target.output.weight.detach().clone())
    if kind == "glide":
        model = GlideTraining(GlideDraft(cfg.model, 1).init_weights(seed=2), target, head, loss="ce", block=2)
    else:
        model = CloverTraining(CloverDraft(cfg.model).init_weights(seed=2), target, head, loss="ce", block=2)
    optimizer = make_optimizer(model, cfg)
    (_, decayed), (_, kept) = _groups_by_name(model, optimizer)
    want = _decays(model.draft)
    assert sorted(decayed) == sorted(f"draft.{n}" for n, d in want.items() if d)
    assert sorted(kept) == sorted(f"draft.{n}" for n, d in want.items() if not d)
    target_ids = {id(p) for p in target.parameters()} | {id(b) for b in head.buffers()}
    assert not target_ids & {id(p) for g in optimizer.param_groups for p in g["params"]}


# ------------------------------------------------------------------------------------------------
# initial weights


def test_init_stds_per_parameter_kind_and_independent_experts():
    """Matrices N(0, init_std); the residual branches' output projections (attention.wo, the MLP's, the
    shared and routed experts' w2) N(0, init_std / sqrt(2 layers)); norms 1; biases and expert_bias 0."""
    cfg = _cfg(*VARIANTS["qwen2_moe"], "--model.init_std=0.05", "--model.ffn_dim=256", "--model.layers=4")
    model = build_model(cfg.model, seed=3)
    std, out_std = 0.05, 0.05 / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif not _decays(model)[name]:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            want = out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std
            # a sample of n normals has a relative std error of ~1/sqrt(2n): 4 of them for the smallest (n = 32)
            tolerance = max(0.03, 4 / math.sqrt(2 * p.numel()))
            assert p.double().std().item() == pytest.approx(want, rel=tolerance), name
            assert abs(p.double().mean().item()) < 4 * want / math.sqrt(p.numel()), name
    for layer in moe_layers(model):
        assert torch.equal(layer.router.expert_bias, torch.zeros(4))
        w1 = layer.experts.w1.detach().flatten(1)
        corr = torch.corrcoef(w1.double())  # each expert drawn on its own: no two alike
        assert (corr - torch.eye(4, dtype=torch.float64)).abs().max() < 0.05
    assert model.inv_freq.dtype == torch.float32


def test_no_dropout_a_training_forward_is_deterministic():
    cfg = _cfg(*VARIANTS["qwen2_moe"])
    model = build_model(cfg.model, seed=0).train()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    a = model(tokens)
    torch.manual_seed(2)
    assert torch.equal(a, model(tokens))
    assert not [m for m in model.modules() if isinstance(m, nn.Dropout)]


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_a_drafts_attention_biases_start_at_zero_like_the_targets(kind):
    """A draft over a Qwen2 (q/k/v bias) or attention_bias target: GliDe's init once filled every 1-D
    parameter with 1, biases included, so each q, k and v started shifted by 1 in every coordinate."""
    cfg = _cfg(*VARIANTS["attention_bias"])
    draft = (GlideDraft(cfg.model, 1) if kind == "glide" else CloverDraft(cfg.model)).init_weights(seed=0)
    biases = {n: p for n, p in draft.named_parameters() if n.endswith(".bias")}
    assert len(biases) == 4
    for name, p in biases.items():
        assert torch.equal(p, torch.zeros_like(p)), f"{name} starts at {p[:3].tolist()}"
    for name, p in draft.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name


# ------------------------------------------------------------------------------------------------
# two ranks (FSDP dp_shard 2 / expert parallel 2) against one process


STEPS = 3
LAYOUTS = {"tied_fsdp": [*VARIANTS["tied"], "--model.vocab_size=67", "--model.ffn_dim=50"],  # uneven shards
           "moe_expert_parallel": [*MOE, "--parallel.expert=2"],
           "qwen3_hsdp": [*VARIANTS["qwen3"], "--parallel.dp_replicate=2"]}


def _batch():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return tokens, tokens.roll(-1, 1)


def _train(model, cfg):
    """STEPS AdamW steps on one batch (every rank the same: the ranks' mean gradient is one process's)."""
    optimizer = make_optimizer(model, cfg)
    tokens, labels = _batch()
    for _ in range(STEPS):
        model(tokens, labels=labels).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model) -> dict[str, np.ndarray]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
            for n, p in model.named_parameters()}


def _rank_build_and_train(extra):
    cfg = _cfg(*extra)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = build_llama_training(cfg, torch.device("cpu"), Runtime.create(cfg, rank, world, "cpu"), log=_quiet)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    start = _full(model)
    _train(model, cfg)
    return sharded, model.output is None, start, _full(model)


@pytest.fixture(scope="module")
def two_ranks():
    jobs = [(key, _rank_build_and_train, (extra,)) for key, extra in LAYOUTS.items()]
    return run_spawned_many(2, jobs, timeout=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_two_rank_build_starts_and_trains_as_one_process(two_ranks, layout):
    """Each rank materialises its shards from meta and fills them from the seed: gathered, the weights are
    one process's build with that seed, and after STEPS AdamW steps still one process's (a tied LM head
    stays the embedding: no second copy to drift)."""
    cfg = _cfg(*LAYOUTS[layout])
    ref = build_model(cfg.model, seed=cfg.train.seed)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    _train(ref, cfg)
    for sharded, tied, got_start, got_end in two_ranks[layout]:
        assert sharded and tied == (layout == "tied_fsdp")
        assert sorted(got_start) == sorted(start)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(torch.from_numpy(got_start[name]), start[name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(torch.from_numpy(got_end[name]), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert not np.array_equal(got_start["tok_embeddings.weight"], got_end["tok_embeddings.weight"])


# ------------------------------------------------------------------------------------------------
# model.init_from: a longctx checkpoint or hf:DIR


def _source(cfg, hf: bool):
    """A model far from any seeded init: random weights, norms and biases moved off 1 and 0, a nonzero
    selection bias (left 0 for an HF export: transformers' routers have none)."""
    model = build_model(cfg.model, seed=11)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for layer in moe_layers(model):
            layer.router.expert_bias.copy_(torch.zeros(4) if hf else torch.randn(4, generator=g))
    return model


def _save(model, cfg, root, hf: bool) -> str:
    if hf:
        from longctx.models.hf import save_hf

        root.mkdir()
        save_hf(model, root)
        return f"hf:{root}"
    layout = {"world": 1, "dp_replicate": 1, "dp_shard": 1, "head": 1, "ctx": 1, "window": 0,
              "placement": "head-first", "expert": 1}
    manager = CheckpointManager(root, keep=0, async_save=False, rank=0, world=1, layout=layout,
                                model_cfg=to_dict(cfg)["model"], log=_quiet)
    manager.save(3, model, torch.optim.AdamW(model.parameters()), {"epoch": 0})
    manager.wait()
    return str(root / "step-00000003")


@pytest.mark.parametrize("source", ["checkpoint", "hf", "hf_bf16"])
@pytest.mark.parametrize("variant", ["tied", "qwen2_moe"])
def test_init_from_overwrites_every_parameter_and_recomputes_rope(tmp_path, source, variant):
    hf = source.startswith("hf")
    cfg = _cfg(*VARIANTS[variant])
    src = _source(cfg, hf)
    if source == "hf_bf16":  # a file in bf16 (as published checkpoints are): its values, in fp32 masters
        src.to(torch.bfloat16)
    path = _save(src, cfg, tmp_path / "weights", hf)
    theta, factor = 50000.0, 4.0  # the run extends the context: its RoPE, not the saved one's
    run = _cfg(*VARIANTS[variant], f"--model.init_from={path}", f"--model.rope_theta={theta}",
               "--model.rope_scaling=linear", f"--model.rope_factor={factor}")
    model = build_llama_training(run, torch.device("cpu"), Runtime.create(run, 0, 1, "cpu"), log=_quiet)
    mine = dict(model.named_parameters())
    assert sorted(mine) == sorted(n for n, _ in src.named_parameters())
    for name, p in src.named_parameters():
        assert mine[name].dtype == torch.float32, name  # the fp32 master, whatever the file held
        assert torch.equal(mine[name].detach(), p.detach().float()), name
    for got, want in zip(moe_layers(model), moe_layers(src)):
        assert torch.equal(got.router.expert_bias, want.router.expert_bias)
    hd = cfg.model.dim // cfg.model.heads
    want = torch.tensor([1.0 / (theta ** (2 * i / hd)) / factor for i in range(hd // 2)], dtype=torch.float64)
    assert model.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model.inv_freq.double(), want, rtol=1e-6, atol=0)
    if variant == "tied":  # the LM head is the loaded embedding itself
        assert model.output is None and model.lm_head_weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
