"""The planner's FSDP figures against a real training step under FSDP2 on 4 gloo ranks.

For each layout one job builds the model as training does (Runtime -> build_model -> parallelize
with FSDP2 -> step.make_optimizer), runs one optimizer step of `grad_accum` micro-batches to warm
up, then measures a second step:

- bytes: `library_traffic()` watches the c10d operators FSDP2 issues (all-gathers of the
  parameters, reduce-scatters of the gradients, HSDP all-reduces) and sums, per rank, the bytes a
  ring implementation sends: (n-1)/n of an all-gather's output and of a reduce-scatter's input,
  2 (n-1)/n of an all-reduce's tensor, the convention of comm.py's counters and of the planner.
  comm.py's own collectives (the Ulysses all-to-alls, the document-id all-gather, ring hops) are
  not counted there. The sum must equal `fsdp_bytes_per_step(...)` (gathers every micro-batch,
  gradients reduced once per step), which is what
  the planner's estimate reports as comm_bytes["fsdp"].
- model states: after the step, each rank's local shards of the parameters, their gradients and
  AdamW's exp_avg / exp_avg_sq, summed in bytes from the tensors themselves. The planner assumes 16
  bytes per parameter (fp32 parameter, gradient and two moments) over the FSDP group: that is what
  FSDP2 holds in this fp32 CPU run, and also under bf16 mixed precision on GPUs (the sharded
  parameters and the reduced gradients stay fp32; the bf16 copies are the gathered ones, which the
  planner counts apart), so the bytes are compared directly. The debug model's dims divide by the
  group sizes, so every rank holds exactly the same (no padding).
"""

import pytest

from longctx.config import load_config, to_dict
from longctx.costs.hardware import PRESETS
from longctx.costs.model_states import param_counts
from longctx.costs.shape import MeshShape
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned
from longctx.job.traffic import library_traffic
from longctx.memory.policy import MemoryPolicy
from longctx.parallel.context.volumes import fsdp_bytes_per_step
from longctx.planner.cost import estimate
from longctx.planner.validate import Case, case_config

pytestmark = pytest.mark.slow  # one 4-rank job: 17-45 s on a 2-core CPU

HW = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test")  # fp32 gathers, as on the CPU

CASES = [
    Case("dp4 grad_accum 2", "debug", 256, MeshShape(1, 4, 1, 1), grad_accum=2),
    Case("dp2 x ctx2 grad_accum 4", "debug", 256, MeshShape(1, 2, 1, 2), grad_accum=4),
    Case("dp2 x ctx2 grad_accum 4 sync per micro-batch", "debug", 256, MeshShape(1, 2, 1, 2),
         MemoryPolicy(grad_sync="micro_batch"), grad_accum=4),
    Case("dp2 x head2 (head 2 x ctx 1)", "debug", 256, MeshShape(1, 2, 2, 1)),
    Case("HSDP rep2 x dp2 grad_accum 2", "debug", 256, MeshShape(2, 2, 1, 1), grad_accum=2),
    Case("HSDP rep2 x ctx2", "debug", 256, MeshShape(2, 1, 1, 2)),
]


def _measure(raws):
    from longctx.job import comm
    from longctx.planner.validate_ranks import measured_model_state_bytes, setup_case, train_step

    out = []
    for raw in raws:
        job = setup_case(raw)  # cfg, runtime, model, optimizer, global batch, loss scale
        train_step(*job)  # warm-up: FSDP's lazy init, optimizer state created
        with library_traffic() as traffic:
            train_step(*job, zero_grad=False)
        model, opt = job[2], job[3]
        out.append({"traffic": dict(traffic), "states": measured_model_state_bytes(model, opt)})
        comm.barrier()
    return out


@pytest.fixture(scope="module")
def measured():
    """{case name: [per-rank {"traffic": {op: bytes}, "states": bytes}]}, all layouts in one job."""
    per_rank = run_spawned(4, _measure, [to_dict(case_config(c)) for c in CASES])
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(CASES)}


def _predicted(case):
    cfg = case_config(case)
    return estimate(cfg.model, HW, case.mesh_shape, case.policy, seq_len=case.seq_len, global_batch=case.global_batch,
                    micro_batch=case.micro_batch, gpus_per_node=4, doc_mask=case.docs)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fsdp_bytes_equal_a_real_step(case, measured):
    est = _predicted(case)
    pc = param_counts(case_config(case).model)
    per_step = fsdp_bytes_per_step(pc["total"], pc["root"], case.mesh_shape, case.grad_accum, HW.dtype_bytes,
                                   case.policy.grad_sync)["fsdp"]
    assert est.grad_accum == case.grad_accum
    assert est.comm_bytes["fsdp"]["fsdp"] == per_step
    expected_ops = {"all_gather", "reduce_scatter"} | ({"all_reduce"} if case.mesh_shape.dp_replicate > 1 else set())
    for rank, got in enumerate(measured[case.name]):
        assert set(got["traffic"]) == expected_ops, (rank, got["traffic"])
        assert sum(got["traffic"].values()) == pytest.approx(per_step, rel=1e-12), (rank, got["traffic"], per_step)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_model_states_equal_a_real_step(case, measured):
    predicted = _predicted(case).memory["model_states"]
    assert [r["states"] for r in measured[case.name]] == [pytest.approx(predicted, rel=1e-12)] * case.world


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_training_loops_closed_form_equals_a_real_step(case, measured):
    """The metrics line's FSDP bytes (parallel.volumes.fsdp_bytes_per_step, root gathered once), from
    the training loop's ParallelDims."""
    m = load_config(None, {"model": {"preset": case.preset}}).model
    shape = case.mesh_shape
    dims = ParallelDims(shape.dp_replicate, shape.dp_shard, shape.head, shape.ctx, world_size=shape.world)
    pc = param_counts(m)
    closed = fsdp_bytes_per_step(pc["total"], pc["root"], dims, case.grad_accum, HW.dtype_bytes,
                                 case.policy.grad_sync)["fsdp"]
    for got in measured[case.name]:
        assert sum(got["traffic"].values()) == pytest.approx(closed, rel=1e-12)


def test_gradients_cross_once_per_optimizer_step(measured):
    """With 4 micro-batches the gradients are reduce-scattered once (sync off for the first three):
    the bytes of one micro-batch's reduce-scatter, not four, while the gathers run every micro-batch."""
    step, micro = (next(c for c in CASES if c.grad_accum == 4 and c.policy.grad_sync == g)
                   for g in ("step", "micro_batch"))
    n = step.mesh_shape.fsdp
    total = param_counts(case_config(step).model)["total"]
    once = (n - 1) / n * total * 4  # fp32 gradients, (n-1)/n of them
    for got in measured[step.name]:
        assert got["traffic"]["reduce_scatter"] == pytest.approx(once, rel=1e-12), got["traffic"]
    for got in measured[micro.name]:  # memory.grad_sync = micro_batch: every micro-batch, as before
        assert got["traffic"]["reduce_scatter"] == pytest.approx(4 * once, rel=1e-12), got["traffic"]
