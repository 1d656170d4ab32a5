"""Validation of the cost model against measurement on this machine (CPU, gloo).

For each case (model, sequence length, mesh shape, memory policy, grad_accum) N local processes
run real training steps through the same pieces as `longctx train` (Runtime -> build_model ->
parallelize -> step/loss.py forward_loss_sum / backward over grad_accum micro-batches ->
step/optimizer.py make_optimizer's AdamW; what each rank runs is planner/validate_ranks.py) on a random global
batch with document ids, and report:

- the bytes comm.py counted per mesh dim and label, on every rank, vs the planner's closed form
  (must be equal);
- the bytes FSDP2's own collectives sent (all-gathers, reduce-scatters, HSDP all-reduces, counted
  by `job/traffic.py library_traffic()` from the c10d operators), on every rank, vs the planner's
  `fsdp_bytes_per_step` (must be equal);
- the model-state bytes each rank holds after the optimizer step (its shards of the fp32
  parameters, gradients and AdamW's two moments), vs the planner's model-state figure (the largest
  rank's equal to it: the planner counts the shard FSDP2 pads every rank's to, so a rank of an uneven
  split holds a few rows less);
- activation bytes per rank as `longctx.bench.memory` measures them, vs the planner's activation
  estimate (within 5%), and the host bytes of offloaded activations likewise; under expert parallelism
  (FlexMoE's copy slots filled) those of the rank that received the most rows, against the estimate at the skew
  it measured (planner/validate_experts.py), the plan's at its --expert-skew reported beside; under hierarchical
  dispatch (parallel.expert_ranks_per_node) at the rows it measured on each level, and every rank's bytes on the
  two levels against the planner's forms at its rows (planner/validate_hier.py; `expert_levels_equal_all_ranks`);
- the median step time, vs the planner's predicted step time for this machine (calibrated with
  `hardware.calibrate`), compared as rankings and ratios between mesh shapes.

`longctx plan --validate` runs the default cases and prints JSON; benchmarks/planner_validate.py
runs it with options and writes the docs table. The exit status is 1 when a case fails any of the
byte checks above (each case's row says which: comm_equal_all_ranks, fsdp_equal_all_ranks,
model_states_equal, activations_within_5pct, host_within_5pct, and in a hierarchical case
expert_levels_equal_all_ranks).
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from datetime import date

from .. import strict_json
from ..config import build_config, to_dict
from ..costs.hardware import calibrate
from ..costs.shape import MeshShape
from ..job.devices import machine_record
from ..job.spawn import run_spawned
from ..memory.block_parts import compute_bytes
from ..memory.hier_counts import hierarchical
from ..memory.peak_routing import peak_top_k
from ..memory.policy import MemoryPolicy
from ..progress import phase
from .cost import estimate
from .documents import doc_work_of_ids
from .validate_experts import received_skews
from .validate_hier import hier_saved_at, level_bytes_at, measured_rows
from .validate_ranks import COUNTED, SEED, case_worker, random_batch, ranking_worker


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    seq_len: int
    mesh_shape: MeshShape
    policy: MemoryPolicy = field(default_factory=MemoryPolicy)
    global_batch: int = 0  # sequences per optimizer step; 0 = one per data-parallel rank and micro-batch
    layers: int = 0  # 0 = the preset's
    docs: bool = True  # document masks (packed documents)
    grad_accum: int = 1  # micro-batches per optimizer step
    # under expert parallelism (mesh_shape.expert > 1): the plan's --expert-skew, whose prediction is reported
    # beside the one at the skew the run measured (planner/validate_experts.py)
    expert_skew: float = 1.0

    def __post_init__(self):
        if not self.global_batch:
            object.__setattr__(self, "global_batch", self.mesh_shape.dp * self.grad_accum)
        if self.global_batch % (self.mesh_shape.dp * self.grad_accum):
            raise ValueError(f"case {self.name}: global batch {self.global_batch} does not split into grad_accum "
                             f"{self.grad_accum} x dp {self.mesh_shape.dp}")
        shape = self.mesh_shape
        if hierarchical(shape.expert, shape.expert_ranks_per_node) and self.policy.recompute != "none":
            # (planner/validate_hier.py puts the measured P and S in place of one stored call per MoE layer)
            raise ValueError(f"case {self.name}: a hierarchical expert dispatch case is compared at its measured rows "
                             f"for stored MoE calls only; give it memory.recompute none, not {self.policy.recompute}")

    @property
    def world(self) -> int:
        return self.mesh_shape.world

    @property
    def micro_batch(self) -> int:
        """Sequences per data-parallel rank per micro-batch."""
        return self.global_batch // (self.mesh_shape.dp * self.grad_accum)


def _mesh(**kw) -> MeshShape:
    kw.setdefault("dp_shard", 1)
    return MeshShape(**kw)


# Step-time ranking: 4 ranks, debug model, 4K tokens with packed documents, 4 sequences per step.
RANKING_CASES = [
    Case("ctx4", "debug", 4096, _mesh(ctx=4), global_batch=4),
    Case("dp2xctx2", "debug", 4096, _mesh(dp_shard=2, ctx=2), global_batch=4),
    Case("head2xctx2", "debug", 4096, _mesh(head=2, ctx=2), global_batch=4),
    Case("dp4", "debug", 4096, _mesh(dp_shard=4), global_batch=4),
    Case("head4", "debug", 4096, _mesh(head=4), global_batch=4),
    Case("ctx4 full", "debug", 4096, _mesh(ctx=4), MemoryPolicy("full"), global_batch=4),
    Case("head4 full", "debug", 4096, _mesh(head=4), MemoryPolicy("full"), global_batch=4),
]

# hierarchical dispatch: an expert group of 4 as 2 nodes of 2 (compared at the rows each level measured)
HIER_CASE = Case("debug-moe dp4 ep4 hier2", "debug-moe", 256, _mesh(dp_shard=4, expert=4, expert_ranks_per_node=2),
                 MemoryPolicy("none"), expert_skew=2.0)

# Bytes and activations: debug and ~100M models under mesh shapes x policies (short, exact checks).
BYTES_CASES = [
    Case("debug single", "debug", 2048, _mesh()),
    Case("debug ctx2", "debug", 2048, _mesh(ctx=2)),
    Case("debug head2", "debug", 2048, _mesh(head=2)),
    Case("debug head2xctx2 full", "debug", 2048, _mesh(head=2, ctx=2), MemoryPolicy("full")),
    Case("debug ctx4/w2 selective", "debug", 2048, _mesh(ctx=4, window=2), MemoryPolicy("selective")),
    Case("debug dp2xctx2 selective+off0.5", "debug", 2048, _mesh(dp_shard=2, ctx=2), MemoryPolicy("selective", 0.5),
         global_batch=2),
    Case("debug rep2xhead2 ctx-first", "debug", 2048, _mesh(dp_replicate=2, head=2, placement="ctx-first"),
         global_batch=2),
    Case("100m head2xctx2", "small-100m", 1024, _mesh(head=2, ctx=2)),
    Case("100m ctx4 selective", "small-100m", 1024, _mesh(ctx=4), MemoryPolicy("selective")),
    Case("100m head4 full", "small-100m", 1024, _mesh(head=4), MemoryPolicy("full")),
    # a plan with FlexMoE copies (planned at skew 2; compared at the skew its hottest rank measured)
    Case("debug-moe ctx2 ep2 copies1", "debug-moe", 1024, _mesh(ctx=2, expert=2, expert_replicas=1),
         MemoryPolicy("none"), expert_skew=2.0),
    HIER_CASE,
]


def case_config(case: Case):
    shape = case.mesh_shape
    raw = {
        "model": {"preset": case.preset, **({"layers": case.layers} if case.layers else {})},
        "parallel": {"dp_replicate": shape.dp_replicate, "dp_shard": shape.dp_shard, "head": shape.head,
                     "ctx": shape.ctx, "window": shape.window if shape.window and shape.window < shape.ctx else 0,
                     "placement": shape.placement, "expert": shape.expert,
                     "expert_replicas": shape.expert_replicas, "expert_ranks_per_node": shape.expert_ranks_per_node},
        "memory": case.policy.to_config(),
        "train": {"seq_len": case.seq_len, "global_batch": case.global_batch, "grad_accum": case.grad_accum,
                  "device": "cpu", "dtype": "fp32", "seed": SEED, "eval_interval": 0},
        "data": {"doc_mask": case.docs},
    }
    return build_config(raw)


def run_case(case: Case, hw, steps: int = 3, warmup: int = 1) -> dict:
    cfg = case_config(case)
    with phase(f"plan --validate: case {case.name} on {case.world} ranks", done_line=False):  # (minutes: said)
        per_rank = run_spawned(case.world, case_worker, to_dict(cfg), steps, warmup, threads=1)
    est, predicted = _predict(case, hw, cfg)
    expert_rows = _expert_rows(case, cfg, per_rank, hw)
    if expert_rows:  # the most loaded rank against the prediction at its measured skew
        est = expert_rows.pop("estimate")
    acts_predicted = expert_rows.pop("activations_predicted", est.memory["activations"])
    measured = per_rank[0]["counters"]
    all_equal = all(r["counters"] == predicted for r in per_rank)
    fsdp_predicted = est.comm_bytes.get("fsdp", {}).get("fsdp", 0.0)
    step_times = [statistics.median(r["times"]) for r in per_rank]
    row = {
        "case": case.name, "preset": case.preset, "seq_len": case.seq_len, "world": case.world,
        "global_batch": case.global_batch, "grad_accum": est.grad_accum, "micro_batch": est.micro_batch,
        "layout": est.as_dict()["layout"], "policy": est.as_dict()["policy"],
        "comm_predicted": predicted, "comm_measured_rank0": measured, "comm_equal_all_ranks": all_equal,
        "fsdp_predicted": fsdp_predicted, "fsdp_measured": [r["fsdp"] for r in per_rank],
        "fsdp_equal_all_ranks": all(abs(sum(r["fsdp"].values()) - fsdp_predicted) <= 1e-6 * max(fsdp_predicted, 1)
                                    for r in per_rank),
        "model_states_predicted": est.memory["model_states"],
        "model_states_measured": [r["model_states"] for r in per_rank],
        "step_s_measured": max(step_times), "step_s_predicted": est.step_s,
        "predicted_times": est.times,
        "activations_predicted": acts_predicted,
        "host_predicted": est.host["activations"] + est.host["attention_offload"],
    }
    row["activations_measured"] = [r["activations"]["device"] for r in per_rank]
    if expert_rows:  # (every rank's kept beside the one compared)
        row.update(expert_rows, activations_measured_all_ranks=row["activations_measured"])
        row["activations_measured"] = [row["activations_measured"][expert_rows["expert_hottest_rank"]]]
    row["host_measured"] = [r["activations"]["host"] for r in per_rank]
    row["activations_max_rel_error"] = max(abs(a - acts_predicted) / acts_predicted
                                           for a in row["activations_measured"])
    # the verdicts the exit status reads (it read the bytes only: activations 20% off exited 0)
    row["model_states_equal"] = math.isclose(max(row["model_states_measured"]), row["model_states_predicted"],
                                             rel_tol=1e-9)
    row["activations_within_5pct"] = row["activations_max_rel_error"] <= 0.05
    row["host_within_5pct"] = all(abs(h - row["host_predicted"]) <= max(0.05 * row["host_predicted"], 1)
                                  for h in row["host_measured"])
    return row


def _predict(case: Case, hw, cfg, expert_skew: float | None = None):
    batch = random_batch(cfg)  # the batch the ranks train on: its documents' share of causal attention
    work = doc_work_of_ids(batch.doc_ids) if batch.doc_ids is not None else 1.0
    est = estimate(cfg.model, hw, case.mesh_shape, case.policy, seq_len=case.seq_len, global_batch=case.global_batch,
                   micro_batch=case.micro_batch, gpus_per_node=case.world, doc_mask=cfg.data.doc_mask,
                   doc_work=work, expert_skew=case.expert_skew if expert_skew is None else expert_skew)
    # (the dims the workers count: an expert all-to-all's bytes follow the run's routing, not the even closed form)
    predicted = {d: {k: int(v) for k, v in labels.items()} for d, labels in est.comm_bytes.items() if d in COUNTED}
    return est, predicted


def _expert_rows(case: Case, cfg, per_rank: list[dict], hw) -> dict:
    """Under expert parallelism: the rank of the first expert group that received the most rows, the skews
    measured, and the estimate at that rank's skew (with the plan's at case.expert_skew); {} at expert 1."""
    shape = case.mesh_shape
    if shape.expert <= 1:
        return {}
    if hierarchical(shape.expert, shape.expert_ranks_per_node):
        return _hier_rows(case, cfg, per_rank, hw)
    skews = received_skews([r["expert_counts"] for r in per_rank[:shape.expert]], cfg.model.moe_experts,
                           shape.expert, shape.expert_replicas)
    hottest = max(range(len(skews)), key=skews.__getitem__)
    planned, _ = _predict(case, hw, cfg)
    return {"expert_skew_measured": skews, "expert_hottest_rank": hottest, "expert_skew_planned": case.expert_skew,
            "activations_predicted_at_planned_skew": planned.memory["activations"],
            "estimate": _predict(case, hw, cfg, expert_skew=max(skews))[0]}


def _hier_rows(case: Case, cfg, per_rank: list[dict], hw) -> dict:
    """_expert_rows under hierarchical dispatch (planner/validate_hier.py): the rows each rank of the first expert
    group measured on each level; the rank whose experts received the most rows, its activations predicted at its
    receive skew with its own P and S (and at the expectation, beside); every rank's bytes on the two levels
    against the planner's forms at its rows."""
    shape, m = case.mesh_shape, cfg.model
    group = per_rank[:shape.expert]
    figs = measured_rows([r["expert_counts"] for r in group], shape.expert_ranks_per_node, peak_top_k(m))
    hottest = max(range(len(figs)), key=lambda q: figs[q]["receive_skew"])
    skew = figs[hottest]["receive_skew"]
    est = _predict(case, hw, cfg, expert_skew=skew)[0]
    c = compute_bytes(hw.dtype_bytes, False)  # (fp32 on the CPU: no autocast)
    at_rows, at_expectation = hier_saved_at(m, c, figs[hottest], shape.expert, shape.expert_ranks_per_node, skew)
    levels_predicted = [level_bytes_at(m, f, shape.expert, shape.expert_ranks_per_node, hw.dtype_bytes) for f in figs]
    levels_measured = [r["expert_levels"] for r in group]
    planned, _ = _predict(case, hw, cfg)
    return {"expert_hier_rows": figs, "expert_skew_measured": [f["receive_skew"] for f in figs],
            "expert_hottest_rank": hottest, "expert_skew_planned": case.expert_skew,
            "activations_predicted_at_planned_skew": planned.memory["activations"],
            # the count at the measured skew with P and S at their expectation (the planner's figure there)
            "activations_predicted_at_expected_rows": est.memory["activations"],
            "activations_predicted": est.memory["activations"] - at_expectation + at_rows,
            "expert_levels_predicted": levels_predicted, "expert_levels_measured": levels_measured,
            "expert_levels_equal_all_ranks": levels_measured == levels_predicted, "estimate": est}


def run_ranking(cases: list[Case], hw, rounds: int = 5) -> list[dict]:
    """Measured (median over rounds, max over ranks) vs predicted step time of same-world cases."""
    world = cases[0].world
    if any(c.world != world for c in cases):
        raise ValueError("ranking cases must share one world size (the same processes run them all)")
    cfgs = [case_config(c) for c in cases]
    with phase(f"plan --validate: {rounds} rounds of {len(cases)} ranking cases on {world} ranks", done_line=False):
        per_rank = run_spawned(world, ranking_worker, [to_dict(c) for c in cfgs], rounds, threads=1)
    rows = []
    for i, (case, cfg) in enumerate(zip(cases, cfgs)):
        est, predicted = _predict(case, hw, cfg)
        # a step ends when its slowest rank ends: the per-round max over ranks, then the median
        per_round = [max(r["times"][i][k] for r in per_rank) for k in range(rounds)]
        rows.append({
            "case": case.name, "preset": case.preset, "seq_len": case.seq_len, "world": case.world,
            "global_batch": case.global_batch, "grad_accum": case.grad_accum, "docs": case.docs,
            "layout": est.as_dict()["layout"], "policy": est.as_dict()["policy"],
            "step_s_measured": statistics.median(per_round), "step_s_rounds": per_round,
            "step_s_predicted": est.step_s, "predicted_times": est.times,
            "comm_equal_all_ranks": all(r["counters"][i] == predicted for r in per_rank),
        })
    return rows


def ranking_agreement(rows: list[dict]) -> dict:
    """Kendall-style check: every pair of cases ordered the same way by measurement and prediction."""
    names = [r["case"] for r in rows]
    meas = {r["case"]: r["step_s_measured"] for r in rows}
    pred = {r["case"]: r["step_s_predicted"] for r in rows}
    by_meas = sorted(names, key=meas.get)
    by_pred = sorted(names, key=pred.get)
    discordant = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
                  if (meas[a] - meas[b]) * (pred[a] - pred[b]) < 0]
    return {"measured_order": by_meas, "predicted_order": by_pred, "same_order": by_meas == by_pred,
            "discordant_pairs": discordant}


def main(args=None, cases=None, ranking_cases=None, steps: int = 3, world_for_calibration: int = 4) -> int:
    with phase(f"plan --validate: measuring this machine on {world_for_calibration} ranks", done_line=False):
        hw = calibrate(world=world_for_calibration)  # (spawned ranks, tens of seconds on a loaded machine)
    print(strict_json.dumps({"calibrated": hw.source, "peak_tflops": hw.peak_tflops,
                      "attention_efficiency": hw.attention_efficiency}), file=sys.stderr, flush=True)
    out = {"bench": "planner_validate", "date": date.today().isoformat(), "hardware": hw.__dict__, "bytes": [],
           "ranking": [], "machine": machine_record()}
    for case in (BYTES_CASES if cases is None else cases):
        row = run_case(case, hw, steps=1, warmup=1)  # step times of these cases are not compared
        print(strict_json.dumps(row), file=sys.stderr, flush=True)
        out["bytes"].append(row)
    ranking_cases = RANKING_CASES if ranking_cases is None else ranking_cases
    out["ranking"] = run_ranking(ranking_cases, hw, rounds=steps) if ranking_cases else []
    for row in out["ranking"]:
        print(strict_json.dumps(row), file=sys.stderr, flush=True)
    if out["ranking"]:
        out["ranking_agreement"] = ranking_agreement(out["ranking"])
    print(strict_json.dumps(out, indent=2))
    checks = ("fsdp_equal_all_ranks", "model_states_equal", "activations_within_5pct", "host_within_5pct",
              "expert_levels_equal_all_ranks")
    ok = all(r["comm_equal_all_ranks"] for r in out["bytes"] + out["ranking"]) and \
        all(r.get(check, True) for r in out["bytes"] for check in checks)
    return 0 if ok else 1
