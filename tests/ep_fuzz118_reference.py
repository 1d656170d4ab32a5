"""Pure-CPU half of tests/distributed/test_ep_fuzz118.py: the random cases (a MoE model, its expert-parallel
layout on 4 ranks, a skewed routing) and the one-process run every rank is held to.

A case is a dict of plain values (picklable: the spawned ranks rebuild it from its seed). Both sides build the
same model (build_model's seed, then `skew`), the same global batch (planner/validate_ranks.py random_batch) and
run the same 3 optimizer steps (AdamW, make_optimizer); `Recorder` notes, for the first step's forward, each
MoE layer call's choices, capacity flags and output per token, keyed by the token's place in the micro-batch
(one device's row-major order over [rows, seq]), so that a layout's tokens can be compared with one process's
token by token."""

from __future__ import annotations

import math
import random

import torch

from longctx.config import load_config
from longctx.models.llama import build_model
from longctx.models.moe import moe_layers
from longctx.planner.validate_ranks import SEED, random_batch
from longctx.step.optimizer import make_optimizer

WORLD, STEPS = 4, 3
SKEWS = ("hot", "cold-rank", "hot+cold-rank")


def make_case(seed: int) -> dict:
    """One random case: experts, top-k, router, capacity, shared experts, the fold of expert parallelism over
    the 4 ranks (expert x head x ctx, the rest data parallel), the dispatcher and a skew."""
    r = random.Random(seed)
    experts = r.choice((4, 6, 8))
    expert = r.choice([d for d in (2, 4) if experts % d == 0])
    head, ctx = r.choice(((1, 1), (1, 2), (2, 1), (2, 2), (1, 4)))
    router = r.choice(("softmax", "softmax", "softmax", "switch", "switch", "dts", "dts", "sigmoid", "sinkhorn"))
    top_k = 1 if router == "switch" else r.choice((1, 2, 2))
    capacity = 0.0 if router in ("dts", "sinkhorn") else r.choice((0.0, 0.5, 1.0, 1.25))
    groups = r.choice((1, 2)) if router == "sigmoid" else 1  # (DeepSeek-V3's group-limited choice)
    recompute = r.choice(("none", "none", "selective", "full"))
    block_chunk = 0 if recompute == "none" else r.choice((0, 0, 24))  # pieces of a rank's call
    per_node = r.choice((0, 0, expert // 2))  # hierarchical dispatch: 2 nodes of expert / 2 ranks
    replicas = 0 if per_node else r.choice((0, 0, 1, 2))
    unit = 2 * head * ctx if head * ctx > 1 else 1  # the zigzag layout's cut; otherwise any length
    seq = unit * r.choice((5, 7, 9, 11)) if unit > 1 else r.choice((37, 41, 43, 53))
    local, hot, cold = experts // expert, r.randrange(experts), r.randrange(expert)
    skew = r.choice(SKEWS)
    if "cold" in skew and hot // local == cold:  # (the cold rank wins: the hot expert moves off it)
        hot = (hot + local) % experts
    return dict(seed=seed, experts=experts, top_k=top_k, router=router, norm_topk=r.choice((True, False)),
                capacity=capacity, shared=r.choice((0, 32)), shared_gate=r.choice((True, False)),
                scope=r.choice(("per_layer_mean", "per_layer_sum", "pooled")), expert=expert, head=head, ctx=ctx,
                chunks=r.choice((1, 1, 2, 3, 0)), replicas=replicas, per_node=per_node,
                skew=skew, hot=hot, cold=cold,
                hot_bias=r.choice((0.3, 0.5, 1.0)), seq=seq, rows=r.choice((1, 2)),
                groups=groups, topk_groups=r.randint(1, groups), recompute=recompute, block_chunk=block_chunk)


def describe(case: dict) -> str:
    c = case
    dispatch = (f"hier{c['per_node']}" if c["per_node"] else "flat") + (f"-chunks{c['chunks']}" if c["chunks"] != 1
                                                                         else "")
    dispatch += f"-copies{c['replicas']}" if c["replicas"] else ""
    dispatch += f"-{c['recompute']}" if c["recompute"] != "none" else ""
    dispatch += f"-pieces{c['block_chunk']}" if c["block_chunk"] else ""
    shared = f"-shared{'gated' if c['shared_gate'] else ''}" if c["shared"] else ""
    router = c["router"] + (f"{c['topk_groups']}of{c['groups']}groups" if c["groups"] > 1 else "")
    return (f"{c['seed']}:E{c['experts']}-{router}-top{c['top_k']}-cap{c['capacity']}{shared}-"
            f"ep{c['expert']}xh{c['head']}xc{c['ctx']}-{dispatch}-{c['skew']}-seq{c['seq']}")


def config(case: dict):
    c = case
    dp = WORLD // (c["head"] * c["ctx"])
    args = ["--model.preset=debug-moe", "--model.layers=2", "--model.dim=64", "--model.ffn_dim=96",
            "--model.moe.dense_layers=", f"--model.moe.experts={c['experts']}", f"--model.moe.top_k={c['top_k']}",
            f"--model.moe.router={c['router']}", f"--model.moe.norm_topk={str(c['norm_topk']).lower()}",
            f"--model.moe.capacity_factor={c['capacity']}", "--model.moe.expert_dim=48",
            f"--model.moe.shared_dim={c['shared']}", f"--model.moe.shared_gate={str(c['shared_gate']).lower()}",
            f"--model.moe.aux_loss_scope={c['scope']}", "--model.moe.aux_loss=0.05", "--model.moe.z_loss=0.01",
            "--model.moe.dts_steps=2", f"--model.moe.groups={c['groups']}",
            f"--model.moe.topk_groups={c['topk_groups']}", f"--train.seq_len={c['seq']}",
            f"--train.global_batch={dp * c['rows']}",
            "--train.device=cpu", "--train.dtype=fp32", "--train.lr=1e-3", "--train.warmup_steps=0",
            f"--parallel.expert={c['expert']}", f"--parallel.head={c['head']}", f"--parallel.ctx={c['ctx']}",
            f"--parallel.expert_pipeline_chunks={c['chunks']}", f"--parallel.expert_replicas={c['replicas']}",
            "--parallel.expert_placement_window=1", f"--memory.recompute={c['recompute']}",
            f"--memory.block_chunk={c['block_chunk']}", f"--parallel.expert_ranks_per_node={c['per_node']}"]
    if not c["shared"]:
        args = [a for a in args if "shared_gate" not in a]
    return load_config(overrides=args)


def skew(model, case: dict) -> None:
    """The case's skew through the routers' selection bias (which the Sinkhorn router's assignment ignores): `hot`
    one expert is chosen by 60-100% of the tokens (hot_bias 1: every token; 0.3-0.5: a share, as the probabilities
    of the gate scaled by 8 spread), `cold-rank` every expert of one expert-parallel rank is never chosen (its
    all-to-all pieces are empty), unless the router must route to every expert (DTS-Gate's first steps)."""
    local = case["experts"] // case["expert"]
    bias = torch.zeros(case["experts"])
    if "hot" in case["skew"]:
        bias[case["hot"]] = case["hot_bias"]
    if "cold" in case["skew"]:
        bias[case["cold"] * local:(case["cold"] + 1) * local] = -10.0
    for layer in moe_layers(model):
        layer.router.gate.weight.data.mul_(8.0)  # probabilities that spread: a small bias moves some tokens only
        layer.router.expert_bias.copy_(bias)


def bare_model(case: dict, cfg):
    model = build_model(cfg.model, device="cpu", seed=SEED).train()
    skew(model, case)
    return model


def docs_kept(choices: torch.Tensor, capacity_factor: float, experts: int) -> torch.Tensor:
    """[N, k] docs/moe.md's capacity over a micro-batch's choices [N, k] in one-device order, written from the page:
    each expert keeps at most ceil(factor x N x k / E) choices (the product in floating point), slot 0's first,
    then in token order; the others are dropped."""
    n, k = choices.shape
    capacity = math.ceil(capacity_factor * n * k / experts)
    taken, kept = [0] * experts, torch.zeros(n, k, dtype=torch.bool)
    for slot in range(k):
        for token in range(n):
            e = int(choices[token, slot])
            kept[token, slot] = taken[e] < capacity
            taken[e] += 1
    return kept


class Recorder:
    """Per MoE layer call (or piece of one, under memory.block_chunk) of a recorded forward: (places [T], choices
    [T, k], kept [T, k] or None, output [T, dim]). `places(layer, flat)`: each token's place in the micro-batch
    (one process: its flat index)."""

    def __init__(self, model, places=None):
        self.on, self.calls, self._pending = False, [], None
        self._places = places or (lambda layer, flat: torch.arange(flat.shape[0]))
        for i, layer in enumerate(moe_layers(model)):
            self._wrap(i, layer)

    def _wrap(self, i, layer):
        route = layer.route

        def recorded(flat, chosen=None, kept=None):
            r = route(flat, chosen, kept)
            if self.on:
                self._pending = [i, self._places(layer, flat), r.experts.clone(),
                                 None if r.kept is None else r.kept.clone(), None]
            return r
        layer.route = recorded

        def output(mod, inputs, out):
            if self.on and self._pending is not None:  # (not a pieces' first pass: it routes nothing)
                self._pending[4] = out.detach().reshape(-1, out.shape[-1]).clone()
                self.calls.append(self._pending)
                self._pending = None
        layer.register_forward_hook(output)

    def by_place(self) -> dict:
        """{layer: (choices, kept, output)} in one-device order (each layer called once per forward)."""
        out = {}
        for i, places, choice, kept, y in self.calls:
            assert i not in out, "one call per layer in one process"
            order = torch.argsort(places)
            out[i] = (choice[order], None if kept is None else kept[order], y[order])
        return out


def reference(case: dict) -> dict:
    """One process: the first step's per-token routing and outputs, router terms and gradients, and the losses
    (cross-entropy over the batch, aux and z statistics) of STEPS optimizer steps."""
    cfg = config(case)
    model = bare_model(case, cfg)
    batch = random_batch(cfg)
    recorder = Recorder(model)
    opt = make_optimizer(model, cfg)
    out = {"losses": [], "stats": []}
    for step in range(STEPS):
        model.set_router_step(step)
        recorder.on = step == 0
        ce = model(batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels, loss_reduction="sum")
        ce = ce / batch.valid_tokens
        terms = model.router_terms()
        (ce + terms.loss).backward()
        out["losses"].append(ce.item())
        out["stats"].append(terms.stats.clone())
        if step == 0:
            out.update(calls=recorder.by_place(), counts=terms.counts.clone(), dropped=terms.dropped.clone(),
                       aux=terms.loss.item(), grads={n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out
