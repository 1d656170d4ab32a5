"""No device-to-host synchronisation inside a step's forward and backward.

Each case builds the training loop's Trainer, runs one step to warm up (lazy FSDP init, plans and
caches filled), then runs two more with a detector around every step's forward and backward
(`Trainer.device_section`): on CPU the dispatch probe of host_sync.py, which refuses `.item()`,
`bool(t)`, boolean masks, `nonzero`, `unique` and friends (on CUDA, torch's own sync debug mode
too). The same probe must catch a deliberately inserted `.item()`, so the test can fail. The 4-rank
cases run one after another in one spawned job (run_spawned_many), each with its own Trainer, its
own warm-up step and its own run directory.
"""

import contextlib
import functools

import pytest
import torch

import longctx.ops.grouped as grouped
from host_sync import HostSyncError, no_host_sync
from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

BASE = ["--train.steps=3", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=200", "--train.seq_len=256", "--train.global_batch=4"]

GUARDS = ["--train.spike_factor=3", "--train.spike_window=1", "--train.on_nonfinite=rollback",
          "--checkpoint.interval=100"]
ONE_PROCESS = {
    "plain": ["--data.doc_mask=false"],
    "documents": ["--data.doc_mask=true"],
    "selective": ["--memory.recompute=selective"],
    "offload": ["--memory.recompute=selective", "--memory.offload_fraction=0.5"],
    "chunked loss + chunked attention": ["--memory.loss_chunk=64", "--memory.attention_chunk=64"],
    "grad_accum 2": ["--train.grad_accum=2"],
    # every guard of a long run on: the spike check (window 1, so it runs in the probed steps)
    "guards: spike check, rollback": GUARDS,
}
CPU_GROUPED_KERNEL = grouped.cpu_kernel_available()
# MoE steps run their experts through the grouped kernel path (what a CUDA bf16 run takes; the CPU
# takes it too where torch._grouped_mm has a CPU kernel), forced here for any shape: the loop
# over experts reads the expert counts on the host by design (ops/grouped.py; see
# test_the_cpu_expert_loop_reads_only_the_counts)
MOE = ["--model.preset=debug-moe", "--model.moe.z_loss=0.001"]
MOE_ONE_PROCESS = {
    "moe softmax top-2, aux + z loss, documents": MOE,
    "moe sigmoid groups, aux-loss-free bias": [*MOE, "--model.moe.router=sigmoid", "--model.moe.groups=2",
                                              "--model.moe.topk_groups=1", "--model.moe.aux_loss=0",
                                              "--model.moe.bias_update_rate=0.01"],
    "moe dts gate, selective recompute, grad_accum 2": [*MOE, "--model.moe.router=dts", "--memory.recompute=selective",
                                                       "--train.grad_accum=2"],
}
FOUR_RANKS = {
    "ring (ctx 4, Double-Ring window 2)": ["--parallel.ctx=4", "--parallel.window=2", "--data.doc_mask=false"],
    "Ulysses (head 4)": ["--parallel.head=4"],
    "head 2 x ctx 2, documents, selective, guards": ["--parallel.head=2", "--parallel.ctx=2", "--data.doc_mask=true",
                                                     "--memory.recompute=selective", *GUARDS],
    "FSDP dp 2 x ctx 2, grad_accum 2, chunked": ["--parallel.ctx=2", "--parallel.dp_shard=2", "--train.grad_accum=2",
                                                 "--memory.loss_chunk=64", "--memory.attention_chunk=64"],
}
if CPU_GROUPED_KERNEL:
    FOUR_RANKS["moe head 2 x ctx 2, documents"] = [*MOE, "--parallel.head=2", "--parallel.ctx=2"]


@contextlib.contextmanager
def _grouped_kernel(on: bool):
    """The grouped experts through torch._grouped_mm (no host read of the counts) for the block."""
    fits = grouped._kernel_fits
    if on:
        grouped._kernel_fits = lambda x, w: True
    try:
        yield
    finally:
        grouped._kernel_fits = fits


def _steps_under_probe(overrides, run_dir, inserted_item=False, record=False):
    """Warm-up step, then two steps with the detector: "ok" (raising on the first sync), or with
    `record` the syncs it saw."""
    with _grouped_kernel(MOE[0] in overrides and not record):
        return _probed_steps(overrides, run_dir, inserted_item, record)


def _probed_steps(overrides, run_dir, inserted_item, record):
    from longctx.train.trainer import Trainer

    cfg = load_config("configs/debug.toml", [*BASE, *overrides, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.step(1)
    if inserted_item:  # what the test must catch: a scalar read in a block's forward
        block = trainer.model.layers[0]
        forward = block.forward

        def reading_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            out.sum().item()
            return out

        block.forward = reading_forward
    seen = []

    @contextlib.contextmanager
    def recording():
        with no_host_sync(trainer.device, raise_on_sync=False) as probe:
            yield
        seen.extend(probe.syncs)

    trainer.device_section = recording if record else functools.partial(no_host_sync, trainer.device)
    for step in (2, 3):
        trainer.step(step)
    return seen if record else "ok"


@pytest.mark.parametrize("name", list(ONE_PROCESS))
def test_one_process_step_reads_nothing_from_the_device(name, tmp_path):
    assert _steps_under_probe(ONE_PROCESS[name], tmp_path) == "ok"


@pytest.mark.skipif(not CPU_GROUPED_KERNEL, reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("name", list(MOE_ONE_PROCESS))
def test_moe_step_reads_nothing_from_the_device(name, tmp_path):
    assert _steps_under_probe(MOE_ONE_PROCESS[name], tmp_path) == "ok"


def test_the_cpu_expert_loop_reads_only_the_counts(tmp_path):
    """The loop over experts (ops/grouped.py's fallback where torch._grouped_mm cannot run, forced
    here) reads each layer's expert counts (forward, and its backward keeps them): nothing else in
    an MoE step reads the host."""
    with grouped.use_loop():
        syncs = _steps_under_probe(MOE, tmp_path, record=True)
    assert syncs and {where.split(":")[0] for _, where in syncs} == {"ops/grouped.py"}
    assert {what for what, _ in syncs} == {"Tensor.tolist"}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """{case: per-rank results}: every 4-rank case in one spawned job."""
    base = tmp_path_factory.mktemp("four_ranks")
    return run_spawned_many(4, [(name, _steps_under_probe, (args, str(base / f"case{i}")))
                                for i, (name, args) in enumerate(FOUR_RANKS.items())])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_parallel_step_reads_nothing_from_the_device(name, four_ranks):
    assert four_ranks[name] == ["ok"] * 4


def test_an_inserted_item_is_caught(tmp_path):
    with pytest.raises(HostSyncError, match=r"_local_scalar_dense.*test_host_sync|_local_scalar_dense"):
        _steps_under_probe(ONE_PROCESS["plain"], tmp_path, inserted_item=True)


def test_the_probe_sees_masks_and_bool_but_not_plain_arithmetic():
    x = torch.arange(6.0)
    with no_host_sync(raise_on_sync=False) as probe:
        y = (x * 2 + 1).sum()
        torch.where(x > 2, x, 0.0)
    assert probe.syncs == []
    for read in (lambda: y.item(), lambda: bool(x[0] > 0), lambda: x[x > 2], lambda: x.nonzero(),
                 lambda: torch.unique(x), lambda: x.tolist(), lambda: x.numpy()):
        with no_host_sync(raise_on_sync=False) as probe:
            read()
        assert probe.syncs, read
