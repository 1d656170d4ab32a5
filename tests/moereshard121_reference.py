"""Helpers of tests/distributed/test_moereshard121_ranks.py: the seeded random cases (a small MoE model, a layout
A it trains and saves under, a layout B it resumes under), the run every rank makes through the training loop
(Trainer), and the comparison of a resumed run with the uninterrupted one.

A case is a dict of plain values (picklable: the spawned ranks receive it). A side's layout is a world size and
its degrees (expert, head, ctx, dp_replicate; dp_shard takes what they leave): dp_replicate = world is FSDP off
(every rank holds every weight whole, HSDP with shard groups of one)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SAVED_AT, STEPS = 3, 5  # save at step 3 (A), resume for steps 4-5 (B)
# the factorisations (head, ctx, dp_replicate) of each world size the draws pick from
LAYOUTS = {4: [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 1, 1), (1, 1, 4), (1, 2, 2), (1, 4, 1)],
           2: [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]}
TINY = ["--model.preset=debug-moe", "--model.layers=3", "--model.dim=64", "--model.heads=4", "--model.kv_heads=2",
        "--model.ffn_dim=96", "--model.moe.expert_dim=48", "--train.seq_len=64", "--train.global_batch=4",
        f"--train.steps={STEPS}", "--train.warmup_steps=1", "--train.eval_interval=0", "--train.device=cpu",
        "--train.dtype=fp32", "--metrics.plots=false", "--metrics.progress=false", "--metrics.log_interval=1",
        "--data.max_docs=40", f"--checkpoint.interval={SAVED_AT}", "--checkpoint.keep=3", "--train.lr=3e-3"]


def _side(r: random.Random, world: int, experts: int, window: int, not_expert: int = 0) -> dict:
    head, ctx, rep = r.choice(LAYOUTS[world])
    degrees = [d for d in (1, 2, 4) if d <= world and experts % d == 0 and d != not_expert] or [1]
    expert = r.choice(degrees)
    # under expert parallelism: FSMoE's chunks, a hierarchical dispatch over nodes of one rank, or FlexMoE's copies
    # of hot experts (the case's placement window)
    dispatch = r.choice(("flat", "chunks", "hier", "copies", "copies")) if expert > 1 else "flat"
    return dict(world=world, expert=expert, head=head, ctx=ctx, dp_replicate=rep, dispatch=dispatch, window=window,
                recompute=r.choice(("none", "none", "selective", "full")))


def make_case(seed: int, world_a: int, world_b: int) -> dict:
    """One random case: the model (experts, top-k, router, shared experts, dense layers, aux-loss-free balancing)
    and the two layouts (B's expert degree another than A's where the experts allow)."""
    r = random.Random(seed)
    experts = r.choice((4, 6, 8))
    router = r.choice(("softmax", "softmax", "switch", "sigmoid", "sigmoid", "dts", "dts", "sinkhorn"))
    top_k = 1 if router == "switch" else r.choice((1, 2))
    # FlexMoE's copies: window 2 places at step 3's start, so that step 4 runs the placement the save holds;
    # window 3 saves in the middle of a window (the counts seen so far), placed at step 4's start
    window = r.choice((2, 3))
    a = _side(r, world_a, experts, window)
    b = _side(r, world_b, experts, window, not_expert=a["expert"])
    return dict(seed=seed, experts=experts, router=router, top_k=top_k, shared=r.choice((0, 32)),
                dense=r.choice(("", "0")), bias_rate=0.0 if router == "sinkhorn" else r.choice((0.0, 0.01, 0.01)),
                norm_topk=r.choice((True, False)), capacity=r.choice((0.0, 0.0, 1.25)) if router in (
                    "softmax", "sigmoid") else 0.0, a=a, b=b, async_save=r.choice((True, False)),
                shared_gate=r.choice((True, False)), scope=r.choice(("per_layer_mean", "per_layer_sum", "pooled")),
                # 2 micro-batches a step where every side's data-parallel ranks leave 2 rows each of the 4
                grad_accum=r.choice((1, 2)) if all(s["world"] // (s["head"] * s["ctx"]) <= 2 for s in (a, b)) else 1)


def same_layout_case(seed: int, world: int) -> dict:
    """A case whose B is A (only the save's kind differs): the resumed steps are the uninterrupted run's bitwise."""
    case = make_case(seed, world, world)
    case["b"] = dict(case["a"])
    return case


def describe(case: dict) -> str:
    def side(s):
        rep = f"r{s['dp_replicate']}" if s["dp_replicate"] > 1 else ""
        dispatch = "" if s["dispatch"] == "flat" else f"-{s['dispatch']}" + (
            str(s["window"]) if s["dispatch"] == "copies" else "")
        recompute = "" if s["recompute"] == "none" else f"-{s['recompute']}"
        return f"w{s['world']}e{s['expert']}h{s['head']}c{s['ctx']}{rep}{dispatch}{recompute}"
    c = case
    model = (f"E{c['experts']}-{c['router']}-top{c['top_k']}" + ("-shared" if c["shared"] else "") +
             ("-dense0" if c["dense"] else "") + (f"-bias{c['bias_rate']}" if c["bias_rate"] else "") +
             (f"-cap{c['capacity']}" if c["capacity"] else "") + (f"-accum{c['grad_accum']}" if c["grad_accum"] > 1
                                                                  else "") + f"-{c['scope']}")
    return f"{c['seed']}:{model}:{side(c['a'])}{'-async' if c['async_save'] else ''}>{side(c['b'])}"


def args(case: dict, side: str) -> list[str]:
    c, s = case, case[side]
    model = [f"--model.moe.experts={c['experts']}", f"--model.moe.top_k={c['top_k']}",
             f"--model.moe.router={c['router']}", f"--model.moe.shared_dim={c['shared']}",
             f"--model.moe.dense_layers={c['dense']}", f"--model.moe.bias_update_rate={c['bias_rate']}",
             f"--model.moe.norm_topk={str(c['norm_topk']).lower()}", f"--model.moe.capacity_factor={c['capacity']}",
             "--model.moe.dts_steps=3", "--model.moe.aux_loss=0.01", "--model.moe.z_loss=0.001",
             f"--model.moe.aux_loss_scope={c['scope']}", f"--train.grad_accum={c['grad_accum']}"]
    if c["shared"]:
        model.append(f"--model.moe.shared_gate={str(c['shared_gate']).lower()}")
    layout = [f"--parallel.{k}={s[k]}" for k in ("expert", "head", "ctx", "dp_replicate")]
    layout += {"flat": [], "chunks": ["--parallel.expert_pipeline_chunks=2"],
               "hier": ["--parallel.expert_ranks_per_node=1"],
               "copies": ["--parallel.expert_replicas=1", f"--parallel.expert_placement_window={s['window']}"]}[
        s["dispatch"]] + [f"--memory.recompute={s['recompute']}"]
    return [*TINY, *model, *layout, f"--checkpoint.async={str(c['async_save'] and side == 'a').lower()}"]


def _gathered(trainer) -> dict | None:
    """The full state (weights, buffers, AdamW's state by parameter name), gathered to rank 0 (None elsewhere)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(trainer.model, trainer.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {"model": model, "optim": optim["state"]} if rank == 0 else None


def train(arguments: list[str], run_dir: str) -> dict:
    """One rank's run: its losses by step, the metrics lines' router figures by step, the last checkpoint's
    trainer state (data position, router counts), the routers' step, and the gathered state at the end."""
    from longctx.config import load_config
    from longctx.models.moe import moe_layers
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*arguments, f"--train.run_dir={run_dir}"]), log=lambda *a, **k: None)
    result = trainer.run()
    losses = {result.first_step + i: loss for i, loss in enumerate(result.losses)}
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    moe = {row["step"]: {k: v for k, v in row.items() if k.startswith(("moe_", "expert_rank_load"))}
           for row in lines if "step" in row}
    last = Path(run_dir) / "checkpoints" / f"step-{STEPS:08d}" / "trainer_state.json"
    state = json.loads(last.read_text()) if last.is_file() else None
    router_steps = sorted({m.router.step for m in moe_layers(trainer.model)})
    return {"losses": losses, "moe": moe, "trainer_state": state, "router_steps": router_steps,
            "state": _gathered(trainer)}


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if not a.numel():
        return 0.0
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def state_differences(got: dict, want: dict) -> dict[str, float]:
    """{name: relative difference} of every weight, buffer and AdamW state tensor (exp_avg, exp_avg_sq, step)."""
    out = {}
    assert got["model"].keys() == want["model"].keys(), sorted(got["model"].keys() ^ want["model"].keys())
    for k, v in want["model"].items():
        assert got["model"][k].shape == v.shape, k
        out[f"model.{k}"] = rel(got["model"][k], v)
    assert got["optim"].keys() == want["optim"].keys(), sorted(got["optim"].keys() ^ want["optim"].keys())
    for name, parts in want["optim"].items():
        assert got["optim"][name].keys() == parts.keys() >= {"exp_avg", "exp_avg_sq", "step"}, name
        for part, v in parts.items():
            assert torch.as_tensor(got["optim"][name][part]).shape == torch.as_tensor(v).shape, (name, part)
            out[f"optim.{name}.{part}"] = rel(got["optim"][name][part], v)
    return out
