"""Settings given to `longctx plan` as config overrides are copied into the written plan; the plan now
costs those that change its memory or time, as the run uses them, and refuses those it cannot cost:

- checkpoint.async: DCP's host staging of the states (12 bytes per parameter of the rank's share) in
  the host budget;
- train.co2_outer_momentum > 0: OuterSync's fourth fp32 buffer per parameter (co2 plans);
- train.co2_overlap_steps = d: the outer all-reduce hides under d steps, not H, and H >= d;
- parallel.grad_bucket_blocks = N: FSDP units of N blocks, so two units and one unit's fp32
  gradient gathered at once (0, chosen by the run, is refused);
- parallel.zero_pp_block: qwz / qgz's int8 blocks' scales in the bytes and the time;
- train.stages: other lengths and batches than the planned one, refused.
Before, every one of them was written into the plan without a word and its figures left out."""

import argparse

import pytest

from longctx.errors import ConfigError
from longctx.planner.cli import add_arguments, build_request
from longctx.planner.search import plan

GIB = 2**30


def _request(argv, overrides=()):
    p = argparse.ArgumentParser()
    add_arguments(p)
    req, _ = build_request(p.parse_args(argv), list(overrides))
    return req


def _best(argv, overrides=()):
    return plan(_request(argv, overrides)).best


DENSE = ["--model", "llama3-8b", "--gpus", "16", "--seq-len", "32K", "--hardware", "h100", "--micro-batch", "1",
         "--recompute", "full", "--offload", "none", "--model-states", "device"]
CO2 = ["--model", "llama3-8b", "--gpus", "32", "--seq-len", "8K", "--hardware", "h100", "--hw", "inter_gbps=5",
       "--micro-batch", "1", "--recompute", "selective", "--model-states", "device", "--allow", "co2"]


def test_async_checkpoint_staging_is_in_the_host_memory():
    plain, staged = _best(DENSE), _best(DENSE, ["--checkpoint.async=true"])
    assert plain.host.get("checkpoint_staging", 0.0) == 0.0
    assert staged.host["checkpoint_staging"] > 1 * GIB  # 12 B x 8B parameters / 16 ranks: 5.6 GiB
    assert staged.host_per_node > plain.host_per_node


def test_grad_bucket_blocks_gather_larger_units():
    one, four = _best(DENSE), _best(DENSE, ["--parallel.grad_bucket_blocks=4"])
    # llama3-8b's block: 218M parameters, 2 units gathered in bf16 and one unit's fp32 gradient: 8 B each
    extra = four.memory["gathered_params"] - one.memory["gathered_params"]
    assert extra == pytest.approx(3 * 218_112_000 * 8, rel=0.01)


def test_grad_bucket_blocks_zero_is_refused():
    with pytest.raises(ConfigError, match="grad_bucket_blocks = 0"):
        _request(DENSE, ["--parallel.grad_bucket_blocks=0"])


def test_stages_are_refused():
    with pytest.raises(ConfigError, match="train.stages"):
        _request(DENSE, ["--train.stages=8192:10,32768:10", "--model.max_seq_len=32768"])


def test_co2_outer_momentum_adds_a_buffer():
    from longctx.costs.model_states import co2_params

    req = _request(CO2)
    plain = plan(req).best
    assert plain.mesh_shape.data_parallel == "co2", plain.mesh_shape.describe()
    assert plain.memory["co2_state"] == pytest.approx(3 * 4 * co2_params(req.model, plain.mesh_shape))
    momentum = plan(_request(CO2, ["--train.co2_outer_momentum=0.5"])).best
    assert momentum.mesh_shape.data_parallel == "co2"
    assert momentum.memory["co2_state"] == pytest.approx(4 * 4 * co2_params(req.model, momentum.mesh_shape))


def test_co2_overlap_steps_hide_less():
    # CO2's full overlap hides the outer all-reduce under H = 4 steps (rep8xdp4 co2/H4, 0 s exposed); merged
    # one step after the round end it hides under one step's compute only, whatever H
    full = plan(_request(CO2)).best
    one = plan(_request(CO2, ["--train.co2_overlap_steps=1"])).best
    assert full.mesh_shape.data_parallel == one.mesh_shape.data_parallel == "co2"
    assert full.times["exposed_co2_outer"] == 0.0 < one.times["exposed_co2_outer"]
    assert one.step_s > full.step_s
    with pytest.raises(ConfigError, match="co2_overlap_steps = 4"):
        _request([*CO2, "--co2-local-steps", "2"], ["--train.co2_overlap_steps=4"])


def test_zero_pp_block_changes_the_quantized_bytes():
    argv = ["--model", "llama3-70b", "--gpus", "32", "--seq-len", "32K", "--hardware", "h100", "--hw",
            "inter_gbps=5", "--model-states", "device", "--micro-batch", "1", "--recompute", "full"]
    default, small = _best(argv), _best(argv, ["--parallel.zero_pp_block=32"])
    assert "qwz" in default.mesh_shape.zero_pp and "qwz" in small.mesh_shape.zero_pp
    assert small.comm_bytes["fsdp"]["fsdp"] > default.comm_bytes["fsdp"]["fsdp"]
