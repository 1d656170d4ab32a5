"""Host memory as a budget (issue 49 item 3): the preflight refuses a run whose ranks on this node
would not fit in the free host memory, before any work, with the figures; LONGCTX_HOST_MEMORY_BYTES
stands in for the free memory."""

import pytest

from longctx.config import load_config
from longctx.costs.host_bytes import predicted_rank_bytes
from longctx.errors import ConfigError
from longctx.job.checks import check_layout
from longctx.train.host_budget import BUDGET_ENV, check_host_memory, host_bytes_besides_offload, rank_host_bytes
from longctx.train.preflight import preflight


def config(*overrides):
    return load_config(None, ["--model.preset=small-100m", "--train.seq_len=512", "--train.device=cpu", *overrides])


def test_a_run_over_the_budget_is_refused_before_any_work(monkeypatch):
    # a data store that does not exist: the host check comes first, so it is what the user hears
    cfg = config("--memory.model_states=host_optimizer", "--data.path=/nonexistent/store")
    monkeypatch.setenv(BUDGET_ENV, "1e8")
    with pytest.raises(ConfigError) as err:
        preflight(cfg, 1)
    text = str(err.value)
    need = rank_host_bytes(cfg, check_layout(cfg, 1), "cpu", 1, 1e8)
    assert f"({need['total']:,.0f} bytes) of host memory on this node" in text
    assert f"model states 1.44 GiB ({need['model_states']:,.0f} bytes)" in text
    assert "(100,000,000 bytes)" in text and BUDGET_ENV in text
    assert "memory.model_states=host_optimizer" in text and "To fit, try:" in text


def test_ranks_on_the_node_multiply_and_the_largest_part_names_the_fix(monkeypatch):
    # (llama3-1b: its host states outweigh each rank's CUDA runtime, which small-100m's 0.4 GiB per rank do not)
    cfg = config("--memory.model_states=host", "--train.device=cuda", "--model.preset=llama3-1b")
    dims = check_layout(cfg, 4)
    per_rank = rank_host_bytes(cfg, dims, "cuda", 4, 1e12)
    assert "device (CPU: host memory)" not in per_rank  # on a GPU the device is not host memory
    monkeypatch.setenv(BUDGET_ENV, str(int(per_rank["total"] * 4 - 1)))
    with pytest.raises(ConfigError, match=r"4 ranks x .*memory.model_states=device .*fewer ranks on this node"):
        check_host_memory(cfg, dims, 4, "cuda")
    monkeypatch.setenv(BUDGET_ENV, str(int(per_rank["total"] * 4 + 1)))
    check_host_memory(cfg, dims, 4, "cuda")  # fits: no error


def test_a_run_within_the_budget_passes(monkeypatch):
    cfg = config()
    monkeypatch.setenv(BUDGET_ENV, "64e9")
    check_host_memory(cfg, check_layout(cfg, 1), 1, "cpu")
    monkeypatch.delenv(BUDGET_ENV)
    check_host_memory(cfg, check_layout(cfg, 1), 1, "cpu")  # this machine's free memory holds small-100m


def test_offload_fraction_auto_is_counted_at_its_bound(monkeypatch):
    cfg = config("--memory.recompute=selective", "--memory.offload_fraction=auto", "--train.seq_len=8192")
    dims = check_layout(cfg, 1)
    whole = rank_host_bytes(cfg, dims, "cuda", 1, 1e12)["activations"]
    full = config("--memory.recompute=selective", "--memory.offload_fraction=1.0", "--train.seq_len=8192")
    assert whole == rank_host_bytes(full, dims, "cuda", 1, 1e12)["activations"] > 0
    besides = host_bytes_besides_offload(cfg, dims, "cuda", 8192, cfg.train.global_batch)  # (the data loader's)
    assert 0 < besides < 1e-3 * whole
    assert rank_host_bytes(cfg, dims, "cuda", 1, whole / 2)["activations"] == pytest.approx(0.8 * whole / 2 - besides)
    monkeypatch.setenv(BUDGET_ENV, "1e6")
    with pytest.raises(ConfigError, match="offload_fraction auto counted at 1.0"):
        check_host_memory(cfg, dims, 1, "cuda")


def test_a_bad_budget_is_refused(monkeypatch):
    cfg = config()
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(ConfigError, match="must be a number of bytes"):
        check_host_memory(cfg, check_layout(cfg, 1), 1, "cpu")


def test_cpu_counts_the_device_bytes_as_host_memory():
    cfg = config()
    dims = check_layout(cfg, 1)
    on_cpu, on_gpu = rank_host_bytes(cfg, dims, "cpu", 1, 1e12), rank_host_bytes(cfg, dims, "cuda", 1, 1e12)
    from longctx.costs.shape import MeshShape
    from longctx.memory.policy import MemoryPolicy

    device, _ = predicted_rank_bytes(cfg.model, MeshShape(), MemoryPolicy.from_config(cfg.memory), "device",
                                     seq_len=512, micro_batch=cfg.train.global_batch, grad_accum=1, dtype_bytes=4)
    assert on_cpu["device (CPU: host memory)"] == pytest.approx(device["total"])
    assert on_cpu["total"] > on_gpu["total"]


@pytest.mark.parametrize("seq_len", [128, 4096])
def test_on_cpu_device_and_host_bytes_are_counted_as_one_memory_holds_them(seq_len):
    # host: FSDP2's offloaded gradients appear in the backward as the activations are freed, so one
    # memory holds the larger of the two; device: the foreach AdamW's step holds a fifth copy of the
    # states when the activations are gone; host_optimizer: its gradient buffers meet the activations
    from longctx.costs.host_bytes import rank_params
    from longctx.costs.shape import MeshShape
    from longctx.memory.policy import MemoryPolicy

    cpu_part = {}
    for tier in ("device", "host_optimizer", "host"):
        cfg = config(f"--memory.model_states={tier}", f"--train.seq_len={seq_len}", "--train.global_batch=1")
        dims = check_layout(cfg, 1)
        on_cpu, on_gpu = rank_host_bytes(cfg, dims, "cpu", 1, 1e12), rank_host_bytes(cfg, dims, "cuda", 1, 1e12)
        device, _ = predicted_rank_bytes(cfg.model, MeshShape(), MemoryPolicy.from_config(cfg.memory), tier,
                                         seq_len=seq_len, micro_batch=1, grad_accum=1, dtype_bytes=4)
        # (a GPU run's pinned states are rounded up as torch locks them: tests/unit/test_host_bytes_pinned.py; and
        # its CUDA context and libraries are a part of their own: costs/cuda_runtime.py)
        pinned_extra = sum(on_gpu.get(k, 0.0) - on_cpu.get(k, 0.0)
                           for k in ("model_states", "checkpoint_staging", "cuda_runtime"))
        assert on_cpu["total"] - (on_gpu["total"] - pinned_extra) == pytest.approx(on_cpu["device (CPU: host memory)"])
        cpu_part[tier] = (on_cpu["device (CPU: host memory)"], device)
    n = rank_params(cfg.model, MeshShape())
    got, device = cpu_part["host_optimizer"]
    assert got == pytest.approx(device["total"])
    got, device = cpu_part["host"]
    assert got == pytest.approx(device["total"] - min(4 * n, device["activations"]))
    got, device = cpu_part["device"]
    assert got == pytest.approx(max(device["total"], 20 * n))
    # each side of each rule is taken at one of the lengths
    long = seq_len == 4096
    assert (4 * n < device["activations"]) == long and (device["total"] > 20 * n) == long
    # with gradient accumulation the first micro-batch's gradients stay through the next forward: they meet
    cfg = config("--memory.model_states=host", f"--train.seq_len={seq_len}", "--train.global_batch=2",
                 "--train.grad_accum=2")
    on_cpu = rank_host_bytes(cfg, check_layout(cfg, 1), "cpu", 1, 1e12)
    device, _ = predicted_rank_bytes(cfg.model, MeshShape(), MemoryPolicy.from_config(cfg.memory), "host",
                                     seq_len=seq_len, micro_batch=1, grad_accum=2, dtype_bytes=4)
    assert on_cpu["device (CPU: host memory)"] == pytest.approx(device["total"])


def test_on_cpu_the_layouts_own_states_are_counted():
    """CO2's outer state (3 fp32 copies of the rank's shard, 4 with outer momentum), hpz's node-sharded copy
    of the blocks and larger FSDP units (grad_bucket_blocks) are device memory, which on a CPU run is host
    memory: the preflight counted the plain layout's bytes for all of them (co2: 43% of a rank's bytes missing)."""
    from longctx.costs.host_bytes import hpz_copy_bytes
    from longctx.costs.model_states import co2_params
    from longctx.train.host_budget import CPU_DEVICE, run_shape

    def device(*overrides):
        cfg = config("--train.global_batch=4", *overrides)
        dims = check_layout(cfg, 4)
        return rank_host_bytes(cfg, dims, "cpu", 4, 1e12)[CPU_DEVICE], cfg, run_shape(cfg, dims)

    hsdp = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]
    sync, _, _ = device(*hsdp)
    co2, cfg, shape = device(*hsdp, "--train.data_parallel=co2", "--train.co2_local_steps=2")
    assert co2 - sync == pytest.approx(3 * 4 * co2_params(cfg.model, shape))
    momentum, _, _ = device(*hsdp, "--train.data_parallel=co2", "--train.co2_local_steps=2",
                            "--train.co2_outer_momentum=0.5")
    assert momentum - co2 == pytest.approx(4 * co2_params(cfg.model, shape))
    fsdp, _, _ = device("--parallel.dp_shard=4")
    hpz, cfg, shape = device("--parallel.dp_shard=4", "--parallel.zero_pp=hpz", "--parallel.ranks_per_node=2")
    assert shape.node == 2 and hpz - fsdp == pytest.approx(hpz_copy_bytes(cfg.model, shape, 4))
    assert device("--parallel.dp_shard=4", "--parallel.grad_bucket_blocks=2")[0] > fsdp


def test_a_co2_save_s_host_copy_is_counted_when_the_run_saves():
    """A co2 save copies each rank's own CO2 state to host memory (step/co2.py state_dict), held until the
    save is written: 6 fp32 words per averaged parameter (7 with outer momentum) in the host parts of a run
    that can save (a resumed one also on a signal), none in one that never does (checkpoint.interval 0,
    checkpoint.final false, no resume) or under sync."""
    from longctx.costs.model_states import co2_params
    from longctx.train.host_budget import run_shape

    def part(*overrides):
        cfg = config("--train.global_batch=4", "--parallel.dp_replicate=2", "--parallel.dp_shard=2", *overrides)
        dims = check_layout(cfg, 4)
        return rank_host_bytes(cfg, dims, "cuda", 4, 1e12).get("co2_checkpoint", 0.0), cfg, run_shape(cfg, dims)

    co2 = ["--train.data_parallel=co2", "--train.co2_local_steps=2"]
    saved, cfg, shape = part(*co2)
    assert saved == pytest.approx(6 * 4 * co2_params(cfg.model, shape)) and saved > 0
    assert part(*co2, "--train.co2_outer_momentum=0.5")[0] == pytest.approx(7 * 4 * co2_params(cfg.model, shape))
    assert part(*co2, "--checkpoint.interval=0", "--checkpoint.final=false")[0] == 0.0
    # a run that only resumes still has a checkpoint manager, which saves on a signal (a requeued job's)
    assert part(*co2, "--checkpoint.interval=0", "--checkpoint.final=false", "--checkpoint.resume=auto")[0] == saved
    assert part()[0] == 0.0


def test_every_rank_the_launcher_starts_here_is_counted_whatever_ranks_per_node_says(monkeypatch):
    # `longctx train --nproc 4` starts all 4 ranks on this machine (torchrun --standalone), also when
    # parallel.ranks_per_node = 2 emulates two nodes for hpz: 4 ranks' host bytes, not 2
    cfg = load_config(None, ["--model.preset=debug", "--train.device=cpu", "--train.seq_len=256",
                             "--train.global_batch=4", "--memory.model_states=host", "--parallel.dp_shard=4",
                             "--parallel.zero_pp=hpz", "--parallel.ranks_per_node=2", "--data.path=/nonexistent/store"])
    per_rank = rank_host_bytes(cfg, check_layout(cfg, 4), "cpu", 4, 1e12)["total"]
    monkeypatch.setenv(BUDGET_ENV, str(int(3 * per_rank)))
    with pytest.raises(ConfigError, match=r"4 ranks x "):
        preflight(cfg, 4)
