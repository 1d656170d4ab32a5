"""train.compile: the token-wise parts compiled (CPU inductor) give the eager gradients under every
memory policy, share one compiled graph per part across blocks, and leave the offloader working."""

import copy

import pytest
import torch

from longctx.config import load_config
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.compile import compile_token_wise_parts
from probes import loss_and_grads, reference_run

# (checkpoint, offload fraction, block chunk): one of each kind of wrapper around the parts
POLICIES = [("none", 0.0, 0), ("full", 0.0, 0), ("selective", 0.0, 0), ("selective", 0.5, 0), ("selective", 0.5, 24),
            ("full", 0.5, 24)]


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize("policy,fraction,chunk", POLICIES)
def test_compiled_parts_match_eager(reference, policy, fraction, chunk):
    cfg, base, batch, (ref_loss, ref_grads) = reference
    model = copy.deepcopy(base)
    apply_memory_policy(model.layers, policy, fraction, offload_skip_last=1, block_chunk=chunk)
    compile_token_wise_parts(model.layers)
    for _ in range(2):
        loss, grads = loss_and_grads(model, batch)
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-5, msg=name)


def _graphs(model, batch):
    """(unique compiled graphs, graph breaks) of one forward + backward of a freshly compiled model."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compile_token_wise_parts(model.layers)
    compile_token_wise_parts(model.layers)  # a second call changes nothing
    loss = model(*batch[:3], labels=batch[3])
    loss.backward()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_blocks_share_the_compiled_graphs(reference):
    cfg, base, batch, _ = reference
    model = copy.deepcopy(base)
    apply_memory_policy(model.layers, "selective", 0.0)
    # three blocks, two parts (pre, post): one graph each (parameters are inputs, not constants), no breaks
    assert _graphs(model, batch) == (2, 0)


def test_offload_still_moves_the_compiled_parts_tensors(reference):
    cfg, base, batch, _ = reference
    model = copy.deepcopy(base)
    offloader = apply_memory_policy(model.layers, "selective", 1.0, offload_skip_last=1)
    # the offloaded blocks (under saved-tensor hooks) and the last one (without) compile apart
    assert _graphs(model, batch) == (4, 0)
    loss = model(*batch[:3], labels=batch[3])
    # the compiled parts' saved activations still go through the offloader's hooks: two of three
    # blocks offloaded, each with its norm, MLP and attention tensors on the host (as eager)
    assert len(offloader.host_storage_ptrs()) >= 2 * 10
    loss.backward()


def test_compile_is_a_config_switch():
    cfg = load_config("configs/debug.toml", ["--train.compile=true"])
    assert cfg.train.compile is True
    assert load_config("configs/debug.toml", []).train.compile is False
