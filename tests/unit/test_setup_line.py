"""The run's setup line says what runs (issue 53 item 10): train.compile, the expert degree, the
learning rate and where it came from, the CPU threads; --model.init_from's help names every family
it loads."""

from types import SimpleNamespace

import torch

from longctx.config import fields_by_key, load_config
from longctx.config.hf import FAMILIES
from longctx.config.schema import ModelConfig
from longctx.train.run_lines import describe_run


def _line(overrides, world=2, expert=1):
    cfg = load_config(None, ["--train.seq_len=64", *overrides])
    dims = SimpleNamespace(dp_replicate=1, dp_shard=1, head=1, ctx=world, window=0, placement="head-first",
                           expert=expert)
    return describe_run(cfg, world, dims, torch.nn.Linear(4, 4), torch.device("cpu"), torch.float32, "peak P")[0]


def test_setup_line_names_compile_expert_lr_and_threads():
    line = _line(["--train.compile=true", "--model.preset=debug-moe"], expert=2)
    assert "compiled (train.compile" in line
    assert "ctx 2, head-first (expert 2 folded over them)" in line
    assert "lr 0.003" in line and "CPU thread" in line and "OpenMP wait" in line
    plain = _line([])
    assert "compiled" not in plain and "expert" not in plain


def test_init_from_help_names_every_family_it_loads():
    text = fields_by_key(ModelConfig)["init_from"].metadata["help"]
    flat = text.lower().replace("-", "").replace("_", "")
    missing = [family for family in FAMILIES if family.replace("_", "") not in flat]
    assert not missing, f"--model.init_from's help does not name {missing}"


def test_setup_line_names_the_memory_settings_that_differ_from_the_default():
    line = _line(["--memory.recompute=full", "--memory.block_chunk=16", "--memory.attention_chunk=32",
                  "--memory.grad_sync=micro_batch",
                  "--memory.model_states=host_optimizer", "--train.grad_accum=2", "--train.global_batch=4"])
    for said in ("block_chunk=16", "attention_chunk=32", "grad_sync=micro_batch", "model_states=host_optimizer"):
        assert said in line, (said, line)
    plain = _line([])
    assert not any(k in plain for k in ("block_chunk", "attention_chunk", "expert_chunk", "grad_sync", "model_states"))
