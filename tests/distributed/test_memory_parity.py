"""Memory policies under head 2 x ctx 2 (4 gloo ranks): gradients, communication, accounting, losses.

Every policy must give the `none` policy's gradients and training losses; `selective` must not
re-run attention or its communication in backward; what each block keeps must match the analytic
count (memory/accounting.py) on every rank, to the byte. The batch is sharded as the training loop
shards it (local_batch): a sequence layout planned on the host from the document ids
(balance "docs"), attached to the local ids, so the attention core gathers nothing. The per-policy
measurements and the 4-rank training runs share one spawned job (run_spawned_many).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from longctx.config import load_config
from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned_many
from longctx.memory.accounting import estimate_activations
from longctx.memory.measured import measure_activations
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model
from longctx.parallel.context.sequence import attach_layout, plan_layout, shard_sequence
from longctx.parallel.parallelize import apply_memory, use_sequence_parallel_attention
from longctx.train.trainer import train

POLICIES = [("none", 0.0), ("full", 0.0), ("selective", 0.0), ("selective", 0.5), ("selective", 1.0)]
SEQ, BATCH, LAYERS = 128, 2, 3


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[:, ::7] = -100
    doc = (torch.arange(SEQ) >= 50).long() + (torch.arange(SEQ) >= 90).long()
    doc = doc.expand(BATCH, SEQ).contiguous()
    starts = torch.tensor([0, 50, 90])
    pos = torch.arange(SEQ).expand(BATCH, SEQ) - starts[doc]
    return tokens, pos, doc, labels


def _valid(labels) -> int:
    return int((labels != -100).sum())


def _model_cfg():
    return load_config(overrides=[f"--model.layers={LAYERS}"]).model


def _reference_grads():
    """One process, no memory policy: the gradients every policy and layout must reproduce."""
    cfg = _model_cfg()
    model = build_model(cfg, seed=3)
    tokens, pos, doc, labels = _batch(cfg.vocab_size)
    (model(tokens, pos, doc, labels=labels, loss_reduction="sum") / _valid(labels)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _rank_run(policies):
    """On each rank: for every policy, gradients (summed over ranks), backward comm, block bytes."""
    cfg = load_config(overrides=[f"--model.layers={LAYERS}", "--parallel.head=2", "--parallel.ctx=2",
                                 "--memory.loss_chunk=0"])
    dims = ParallelDims.from_config(cfg, world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    base = build_model(cfg.model, seed=3)
    full = _batch(cfg.model.vocab_size)
    valid = _valid(full[3])  # the gradients are of the mean loss over the whole batch
    layout = plan_layout(full[2], dims.ctx, dims.head, balance="docs")  # as local_batch does
    tokens, pos, doc, labels = (layout.shard(t, mesh) for t in full)
    attach_layout(doc, layout)
    out = {}
    for policy, fraction in policies:
        model = copy.deepcopy(base)
        use_sequence_parallel_attention(model, dims, mesh)
        cfg.memory.recompute, cfg.memory.offload_fraction = policy, fraction
        apply_memory(model, cfg.memory, "cpu")
        # accounting (one forward + backward), then a clean gradient pass with comm counted
        measured = measure_activations(model, tokens, pos, doc, labels=labels)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, doc, labels=labels, loss_reduction="sum") / valid
        comm.reset_counters()
        loss.backward()
        backward_comm = comm.counters()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[name] = g.numpy()  # tensors would travel back through shared memory of an exiting process
        est = estimate_activations(cfg.model, SEQ, BATCH, head=2, ctx=2, policy=MemoryPolicy(policy, fraction, 1),
                                   dtype_bytes=4, docs=True)
        out[(policy, fraction)] = (grads, backward_comm, measured, est.to_dict())
    # Without a layout (bare zigzag-sharded ids), distributed_attention gathers the ids once and
    # keeps the [batch, seq] int64 tensor on the ids' layout: created in block 0, held with the
    # input ids, not an activation of any block.
    model = copy.deepcopy(base)
    use_sequence_parallel_attention(model, dims, mesh)
    cfg.memory.recompute, cfg.memory.offload_fraction = "none", 0.0
    apply_memory(model, cfg.memory, "cpu")
    bare = [shard_sequence(t, mesh) for t in full]
    out["no layout"] = measure_activations(model, *bare[:3], labels=bare[3], backward=False)
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One 4-rank job: the per-policy measurements (_rank_run), then TRAIN_STEPS training steps per policy
    under head 2 x ctx 2 (_losses_per_policy); {key: per-rank results}."""
    run_dir = tmp_path_factory.mktemp("head2-ctx2")
    return run_spawned_many(4, [("measure", _rank_run, (POLICIES,)),
                                ("train", _losses_per_policy, ([*TRAIN, "--parallel.head=2", "--parallel.ctx=2"],
                                                               str(run_dir)))])


@pytest.fixture(scope="module")
def runs(spawned):
    return spawned["measure"]


@pytest.mark.parametrize("policy,fraction", POLICIES)
def test_gradients_match_single_process_none(runs, policy, fraction):
    ref = _reference_grads()
    for rank_out in runs:
        grads = rank_out[(policy, fraction)][0]
        none = rank_out[("none", 0.0)][0]
        for name, g in grads.items():
            g = torch.from_numpy(g)
            diff = (g - torch.from_numpy(none[name])).abs().max().item()
            assert diff <= 1e-6, f"{policy} {fraction} vs none: {name}: max |diff| {diff:.2e}"
            diff = (g - ref[name]).abs().max().item()
            assert diff <= 1e-5, f"{policy} {fraction} vs one process: {name}: max |diff| {diff:.2e}"


def test_selective_backward_communicates_exactly_like_none(runs):
    for rank_out in runs:
        none, sel, full = (rank_out[k][1] for k in [("none", 0.0), ("selective", 0.0), ("full", 0.0)])
        assert none and sum(sum(v.values()) for v in none.values()) > 0
        assert sel == none, f"selective backward comm {sel} != none {none}"
        assert rank_out[("selective", 1.0)][1] == none
        # full recompute re-runs the forward's all-to-all and ring: strictly more
        assert sum(full["head"].values()) > sum(none["head"].values())
        assert sum(full["ctx"].values()) > sum(none["ctx"].values())


@pytest.mark.parametrize("policy,fraction", POLICIES)
def test_block_bytes_match_the_analytic_count(runs, policy, fraction):
    for rank_out in runs:
        _, _, measured, est = rank_out[(policy, fraction)]
        blocks = measured["blocks"]
        offloaded = LAYERS - 1 if fraction > 0 else 0
        for i, b in enumerate(blocks):
            if i >= offloaded:
                expect_dev, expect_host = est["kept_block_device"], 0.0
            elif i == offloaded - 1:
                continue  # its output feeds a kept block and stays: covered by the totals below
            else:
                expect_dev, expect_host = est["per_block_device"], est["per_block_host"]
            assert b["device"] == pytest.approx(expect_dev, rel=0, abs=0.5), (policy, fraction, i, b)
            assert b["host"] == pytest.approx(expect_host, rel=0, abs=0.5), (policy, fraction, i, b)
        # the totals add the loss's scalars, 16 bytes per forward that no per-token count holds: the NLL and
        # its total weight (fp32), and the int64 count of labels the mean divides the sum by (ops/loss.py)
        assert measured["total_device"] - est["total_device"] == pytest.approx(16, abs=0.5)
        assert measured["total_host"] == pytest.approx(est["total_host"], rel=0, abs=0.5)


def test_without_a_layout_the_gathered_ids_are_held_once(runs):
    """The one place documents cost activation-like bytes: bare ids (no layout) make the first
    block gather them, 8 bytes per token of the whole batch, once; every other block is exact."""
    for rank_out in runs:
        measured, est = rank_out["no layout"], rank_out[("none", 0.0)][3]
        blocks = [b["device"] for b in measured["blocks"]]
        assert blocks == [est["kept_block_device"] + 8 * BATCH * SEQ] + [est["kept_block_device"]] * (LAYERS - 1)


def _losses_per_policy(args, run_dir):
    """TRAIN_STEPS training steps per policy, in one process (group): {policy: losses}."""
    out = {}
    for policy, fraction in POLICIES:
        flags = [f"--memory.recompute={policy}", f"--memory.offload_fraction={fraction}"]
        cfg = load_config("configs/debug.toml", [*args, *flags, f"--train.run_dir={run_dir}/{policy}{fraction}"])
        out[(policy, fraction)] = train(cfg, log=lambda *a, **k: None).losses
    return out


TRAIN_STEPS = 3  # steps 2 and 3 follow AdamW updates made from each policy's gradients
TRAIN = [f"--train.steps={TRAIN_STEPS}", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
         "--train.seq_len=256", "--checkpoint.final=false"]  # (only the losses are compared: no save to wait for)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "head2-ctx2"])
def test_training_losses_identical_for_every_policy(layout, request, tmp_path):
    if layout == "single":
        results = _losses_per_policy(TRAIN, str(tmp_path))
    else:
        results = request.getfixturevalue("spawned")["train"][0]
    none = results[("none", 0.0)]
    assert len(none) == TRAIN_STEPS
    for key, losses in results.items():
        diff = max(abs(a - b) for a, b in zip(losses, none))
        assert diff <= 1e-6, f"{layout} {key}: max |loss - none| = {diff:.2e}"


def test_full_offload_leaves_at_most_one_block_plus_block_inputs(runs):
    cfg = _model_cfg()
    for rank_out in runs:
        _, _, measured, est = rank_out[("selective", 1.0)]
        tokens = est["tokens"]
        block_inputs = LAYERS * tokens * cfg.dim * 4
        on_device = sum(b["device"] for b in measured["blocks"])
        assert on_device <= est["kept_block_device"] + block_inputs, (on_device, est)
        # ...while `none` keeps several blocks' worth
        none_device = sum(b["device"] for b in rank_out[("none", 0.0)][2]["blocks"])
        assert none_device > 2 * (est["kept_block_device"] + block_inputs)
