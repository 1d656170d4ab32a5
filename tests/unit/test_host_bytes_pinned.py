"""costs/host_bytes.py on a CUDA run counts pinned host memory as torch's host allocator locks it (every
pinned request rounded up to a power of two: ops/pinned.py), computed here independently of ops/pinned.py:

- `host`: FSDP2's CPU offload pins each weight shard and each gradient copy by itself (rounded), AdamW's
  moments are ordinary memory (exact);
- `host_optimizer`: the masters and gradient buffers HostOptimizer really allocates (a fake pinned
  allocator records them), the moments exact;
- checkpoint.async: DCP's DefaultStager page-locks the staged tensors in place, at their exact sizes;
- a CPU run pins nothing: the exact 16 bytes per parameter, as before (the RSS tests hold it)."""

import math

import pytest
import torch

from longctx.config import load_config
from longctx.costs.host_bytes import checkpoint_staging_bytes, host_state_bytes, predicted_rank_bytes
from longctx.costs.model_states import param_counts
from longctx.costs.shape import MeshShape
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import Llama
from longctx.ops import pinned
from longctx.step.host_optimizer import HostOptimizer, forward_units

M = load_config(None, {"model": {"preset": "debug", "dim": 48, "layers": 2, "heads": 3, "kv_heads": 1,
                                 "ffn_dim": 136, "vocab_size": 200}}).model


def _locked(nbytes):  # the allocator's rounding, written from its contract
    return 2 ** math.ceil(math.log2(nbytes))


def _numels(rows_over=1):
    with torch.device("meta"):
        model = Llama(M)
    return [math.ceil(p.shape[0] / rows_over) * math.prod(p.shape[1:]) for p in model.parameters()]


@pytest.mark.parametrize("shape", [MeshShape(), MeshShape(dp_shard=4)])
def test_host_tier_counts_each_pinned_shard_rounded_up(shape):
    numels = _numels(shape.fsdp)
    n = param_counts(M)["total"] / shape.fsdp
    expected = 2 * sum(_locked(4 * k) for k in numels) + 8 * n
    assert host_state_bytes(M, shape, "host", pinned=True) == pytest.approx(expected)
    assert expected > 16 * n * 1.05  # (the shapes are chosen to round: the figure is not the exact one)
    assert host_state_bytes(M, shape, "host") == 16 * n  # a CPU run pins nothing


def test_host_optimizer_counts_what_it_really_pins(monkeypatch):
    asked = []
    monkeypatch.setattr(pinned, "allocate", lambda n: asked.append(n) or torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(pinned, "pins", lambda device: True)
    model = Llama(M)
    model.init_weights(0)
    HostOptimizer([{"params": list(model.parameters())}], forward_units(model), lr=1e-3)
    n = param_counts(M)["total"]
    assert host_state_bytes(M, MeshShape(), "host_optimizer", pinned=True) == sum(asked) + 8 * n
    assert sum(asked) < 1.1 * 8 * n  # carved: little waste (per tensor it would be the rounded figure)


def test_async_checkpoint_staging_is_page_locked_at_its_exact_size():
    """checkpoint/background.py's DefaultStager (torch's StateDictStager) allocates ordinary storages and
    page-locks them in place (cudaHostRegister): nothing goes through the rounding host allocator (it was
    counted as each staged tensor rounded up to a power of two)."""
    import inspect

    from torch.distributed.checkpoint import _state_dict_stager, staging

    assert "StateDictStager" in inspect.getsource(staging.DefaultStager.__init__)
    assert "pin_memory_utils.pin_memory(" in inspect.getsource(_state_dict_stager.StateDictStager)
    n = param_counts(M)["total"]
    assert checkpoint_staging_bytes(M, MeshShape(), True, pinned=True) == 12 * n
    assert checkpoint_staging_bytes(M, MeshShape(), True) == 12 * n


def test_the_rank_figure_is_pinned_on_cuda_only():
    kw = {"seq_len": 64, "micro_batch": 1, "grad_accum": 1, "dtype_bytes": 4, "async_checkpoint": True}
    _, cpu = predicted_rank_bytes(M, MeshShape(), MemoryPolicy(), "host", device_type="cpu", **kw)
    _, gpu = predicted_rank_bytes(M, MeshShape(), MemoryPolicy(), "host", device_type="cuda", **kw)
    n = param_counts(M)["total"]
    assert cpu["model_states"] == 16 * n and cpu["checkpoint_staging"] == 12 * n
    assert gpu["model_states"] == host_state_bytes(M, MeshShape(), "host", pinned=True) > cpu["model_states"]
    assert gpu["checkpoint_staging"] == cpu["checkpoint_staging"]  # (page-locked in place, exact)
