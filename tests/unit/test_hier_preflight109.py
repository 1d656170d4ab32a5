"""The run's own memory preflight (train/host_budget.py) and its automatic offload fraction (memory/auto.py via
train/model.py) counted a run with hierarchical dispatch (parallel.expert_ranks_per_node) as the flat exchange,
though the planner counts its saved tensors and transients (memory/hier_counts.py, hier_transients.py): what the
run predicts for itself now carries R too."""

from longctx.config import load_config
from longctx.job.checks import check_layout
from longctx.memory.accounting import estimate_activations
from longctx.memory.auto import choose_offload_fraction
from longctx.train.host_budget import CPU_DEVICE, rank_host_bytes, run_shape


def _run(*overrides):
    cfg = load_config(None, ["--model.preset=debug-moe", "--train.seq_len=512", "--train.device=cpu",
                             "--train.global_batch=4", "--parallel.expert=4", *overrides])
    dims = check_layout(cfg, 4)
    return cfg, dims


def test_the_preflight_counts_the_hierarchical_dispatch():
    flat_cfg, flat_dims = _run()
    hier_cfg, hier_dims = _run("--parallel.expert_ranks_per_node=2")
    assert run_shape(hier_cfg, hier_dims).expert_ranks_per_node == 2
    assert run_shape(flat_cfg, flat_dims).expert_ranks_per_node == 0
    flat = rank_host_bytes(flat_cfg, flat_dims, "cpu", 4, 1e12)[CPU_DEVICE]
    hier = rank_host_bytes(hier_cfg, hier_dims, "cpu", 4, 1e12)[CPU_DEVICE]
    assert hier != flat  # (the saved tensors beyond flat: P(4d+20) + S(8+k) - Tk(4d+12) per stored call)


def test_the_offload_fraction_reads_what_the_hierarchical_run_keeps():
    """choose_offload_fraction with R counts the activations estimate_activations gives with R (one host budget
    that fits the flat run's blocks but not the hierarchical run's: the fractions differ)."""
    cfg, _ = _run()
    m = cfg.model
    args = dict(head=1, ctx=1, skip_last=0, dtype_bytes=4, block_seconds=1e-3, link_bytes_per_s=1e12, expert=4)
    flat = estimate_activations(m, 512, 1, expert=4).total_device
    hier = estimate_activations(m, 512, 1, expert=4, expert_ranks_per_node=2).total_device
    assert hier != flat
    assert any(choose_offload_fraction(m, 512, 1, host_bytes_per_rank=h, **args)[0] !=
               choose_offload_fraction(m, 512, 1, host_bytes_per_rank=h, expert_ranks_per_node=2, **args)[0]
               for h in [flat * f / 10 for f in range(1, 40)])
