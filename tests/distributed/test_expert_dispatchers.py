"""The expert-parallel dispatcher (parallel/expert/install.py use_expert_parallel) on 4 gloo ranks:

- every option (flat, pipelined chunks, chunks chosen online, FlexMoE copy slots, hierarchical over
  nodes) installs ONE object on every MoE layer, chosen from the options, says in its repr which
  dispatch it is, replaces no module method, and gives the one-device layer's outputs and input
  gradients (1e-5);
- hierarchical dispatch under FSDP over an expert-data group of 2 (expert 2 x ctx 2 on 4 ranks,
  nodes of 1 rank) trains as the flat exchange does: its experts run inside their module's call,
  where FSDP gathers their weights (before the dispatcher, the hierarchical path bypassed the call
  and failed on the sharded weights)."""

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from longctx.config import ModelConfig
from longctx.job.spawn import run_spawned_many
from longctx.models.moe import MoEFeedForward

OPTIONS = {  # name: (use_expert_parallel's options, the dispatcher's class, what its repr says)
    "flat": ({}, "ExpertParallelDispatcher", "flat all-to-all, 1 chunk"),
    "chunks3": ({"pipeline_chunks": 3}, "ExpertParallelDispatcher", "3 chunk(s)"),
    "online": ({"pipeline_chunks": 0}, "ExpertParallelDispatcher", "chunks chosen online"),
    "copies": ({"replicas": 1, "placement_window": 2}, "ExpertParallelDispatcher", "FlexMoE copies"),
    "hierarchical": ({"ranks_per_node": 2}, "HierarchicalDispatcher", "hierarchical over 2 nodes of 2 ranks"),
}


def _installed():
    from longctx.parallel.expert.install import expert_step_notes, model_dispatcher, use_expert_parallel

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    cfg = ModelConfig(dim=32, ffn_dim=64, moe_experts=8, moe_top_k=2, moe_expert_dim=48)
    torch.manual_seed(0)
    base = nn.Sequential(MoEFeedForward(cfg), MoEFeedForward(cfg))
    for p in base.parameters():
        nn.init.normal_(p, std=0.05)
    rank = torch.distributed.get_rank()
    x = torch.randn(30 + 5 * rank, 32, generator=torch.Generator().manual_seed(100 + rank))
    x1 = x.clone().requires_grad_()
    y1 = base(x1)
    y1.square().sum().backward()
    out = {}
    for name, (options, _, _) in OPTIONS.items():
        model = copy.deepcopy(base)
        dispatcher = use_expert_parallel(model, mesh, **options)
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.square().sum().backward()
        out[name] = {
            "class": type(dispatcher).__name__, "repr": repr(dispatcher),
            "shared": all(layer.dispatcher is dispatcher for layer in model) and model_dispatcher(model) is dispatcher,
            "patched": [n for layer in model for n in ("forward", "route_tokens") if n in vars(layer.experts)],
            "notes": expert_step_notes(model, 1, None),
            "worst": max((y - y1).abs().max().item(), (xi.grad - x1.grad).abs().max().item()),
        }
    return out


def _losses(args, run_dir):
    from longctx.config import load_config
    from longctx.train.trainer import train

    cfg = load_config("configs/debug.toml", ["--model.preset=debug-moe", "--train.steps=3", "--train.eval_interval=0",
                                             "--metrics.plots=false", "--metrics.progress=false",
                                             "--checkpoint.final=false", "--train.seq_len=256",
                                             "--train.global_batch=4", "--data.max_docs=200", *args,
                                             f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


def test_every_option_installs_one_dispatcher_and_matches_one_device(tmp_path):
    layout = ["--parallel.expert=2", "--parallel.ctx=2"]  # 4 ranks: expert-data groups of 2
    results = run_spawned_many(4, [
        ("installed", _installed, ()),
        ("flat", _losses, (layout, str(tmp_path / "flat"))),
        ("hierarchical", _losses, ([*layout, "--parallel.expert_ranks_per_node=1"], str(tmp_path / "hier"))),
    ])
    for per_rank in results["installed"]:
        for name, (_, cls, says) in OPTIONS.items():
            got = per_rank[name]
            assert got["class"] == cls and says in got["repr"], (name, got)
            assert got["shared"] and got["patched"] == [] and got["notes"] == [], (name, got)
            assert got["worst"] <= 1e-5, (name, got["worst"])
    flat, hier = results["flat"][0], results["hierarchical"][0]
    assert len(flat) == len(hier) == 3
    assert max(abs(a - b) for a, b in zip(flat, hier)) <= 1e-5, (flat, hier)
