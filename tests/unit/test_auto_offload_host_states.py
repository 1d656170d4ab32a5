"""memory.offload_fraction = auto beside the host tiers' model states: auto gave the offloaded activations
0.8 x a rank's share of host memory as if nothing else lived there, while memory.model_states host /
host_optimizer keep 16 B per parameter in host memory too (and checkpoint staging, the data loader). The
preflight then counted auto at that cap plus the states and refused runs that a smaller fraction fits, and
under a launcher that runs no preflight (torchrun) the ranks chose a fraction that, with the states, passed
the host's memory. Auto's share now holds the rank's other host bytes too, and the preflight counts it so."""

import dataclasses

import pytest
import torch

from longctx.config import load_config
from longctx.job.checks import check_layout
from longctx.job.runtime import Runtime
from longctx.memory import auto
from longctx.memory.accounting import estimate_activations
from longctx.memory.policy import MemoryPolicy
from longctx.train.host_budget import BUDGET_ENV, check_host_memory, host_bytes_besides_offload, rank_host_bytes
from longctx.train.model import auto_offload_fraction

GIB = 2**30


def _cfg(*more):
    return load_config(None, ["--model.preset=small-100m", "--train.seq_len=4096", "--train.device=cuda",
                              "--memory.model_states=host", "--memory.recompute=selective",
                              "--memory.offload_fraction=auto", *more])


def test_preflight_counts_auto_within_what_the_states_leave(monkeypatch):
    cfg = _cfg()
    dims = check_layout(cfg, 1)
    states = rank_host_bytes(cfg, dims, "cuda", 1, 1e15)["model_states"]
    budget = 5 * states  # the states take a fifth and more of it (with the loader): auto's 0.8 left no room
    besides = host_bytes_besides_offload(cfg, dims, "cuda", 4096, cfg.train.global_batch)
    assert states <= besides < states * 1.05
    need = rank_host_bytes(cfg, dims, "cuda", 1, budget)
    assert need["activations"] == pytest.approx(0.8 * budget - besides)
    # (beside them the rank's CUDA context and libraries, which auto's share inside the rank does not hold)
    assert need["total"] - need["cuda_runtime"] <= 0.8 * budget * (1 + 1e-12)
    monkeypatch.setenv(BUDGET_ENV, str(budget))
    check_host_memory(cfg, dims, 1, "cuda")  # fits: auto picks a fraction the states leave room for


def _auto_config(layers: int, seq_len: int, dtype: str):
    """One process of the host_optimizer tier, selective recompute, offload_fraction auto (the last block kept)."""
    return load_config(overrides=[f"--model.layers={layers}", f"--train.seq_len={seq_len}", "--train.global_batch=1",
                                  "--memory.recompute=selective", "--memory.offload_fraction=auto",
                                  "--memory.offload_skip_last=1", f"--train.dtype={dtype}",
                                  "--memory.model_states=host_optimizer"])


def test_auto_in_the_rank_leaves_room_for_the_states(monkeypatch):
    cfg = _auto_config(5, 4096, "fp32")
    rt = Runtime.create(cfg, 0, 1, "cpu")
    besides = host_bytes_besides_offload(cfg, rt.dims, "cpu", 4096, 1)
    assert besides > 16 * sum(p.numel() for p in torch.nn.Linear(cfg.model.dim, cfg.model.dim).parameters())

    def rank_host(a):
        return estimate_activations(cfg.model, 4096, 1, policy=MemoryPolicy("selective", a, 1)).total_host

    free = (rank_host(0.5) + besides) / 0.8  # room for half of the activations beside the states
    monkeypatch.setattr(auto, "host_memory_available", lambda: free)
    monkeypatch.setattr(auto, "host_link_bandwidth", lambda device: 1e15)
    monkeypatch.setattr(auto, "measured_block_forward_seconds", lambda *a, **k: 1.0)
    a = auto_offload_fraction(cfg, torch.device("cpu"), rt, lambda line: None)
    assert a == pytest.approx(0.5)
    assert rank_host(a) + besides <= 0.8 * free * (1 + 1e-12)


def _offloaded_bytes(cfg, fraction: float) -> int:
    """The host bytes the offloader keeps after one real forward of `cfg`'s model at `fraction`, in bf16
    autocast over fp32 weights as step/loss.py runs one process in bf16."""
    from longctx.data.samples import Batch
    from longctx.models.llama import build_model
    from longctx.parallel.parallelize import apply_memory
    from longctx.step.loss import forward_loss_sum

    model = build_model(cfg.model, seed=0)
    memory = dataclasses.replace(cfg.memory, offload_fraction=fraction)
    apply_memory(model, memory, "cpu")
    seq = cfg.train.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    loss = forward_loss_sum(model, Batch(tokens, tokens.clone(), torch.arange(seq)[None], None), torch.bfloat16)
    held = sum(t.untyped_storage().nbytes() for r in model.memory_offloader.host_tensors if (t := r()) is not None)
    del loss
    return held


def test_auto_counts_an_autocast_run_at_each_tensors_dtype(monkeypatch):
    """One process in bf16 (here on CPU; on one GPU off the host tier alike) is autocast over fp32 weights:
    its offloaded matmul and attention outputs are bf16. Auto counted them at 4 B, 1.5x what the offloader
    keeps, so with host memory for half of the activations it chose 0.25 (half the offload it could do).
    Now the fraction whose measured host bytes fill the share is chosen, and they fit."""
    cfg = _auto_config(3, 1024, "bf16")
    rt = Runtime.create(cfg, 0, 1, "cpu")
    besides = host_bytes_besides_offload(cfg, rt.dims, "cpu", 1024, 1)
    half = _offloaded_bytes(cfg, 0.5)
    free = (half + besides) / 0.8  # room for the offloaded half beside the states
    monkeypatch.setattr(auto, "host_memory_available", lambda: free)
    monkeypatch.setattr(auto, "host_link_bandwidth", lambda device: 1e15)
    monkeypatch.setattr(auto, "measured_block_forward_seconds", lambda *a, **k: 1.0)
    a = auto_offload_fraction(cfg, torch.device("cpu"), rt, lambda line: None)
    assert a == pytest.approx(0.5)
    assert _offloaded_bytes(cfg, a) + besides <= 0.8 * free * (1 + 1e-12)
