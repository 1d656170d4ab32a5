"""train.compile audited against the other model and memory features (each against the same run eager).

A DTS-Gate router's schedule (temperature and experts per token) is read from the router's optimizer step, a
Python int that changes every step: traced into the compiled block `post`, it was a guarded constant, so
every step compiled the MoE block again, until torch._dynamo's recompile limit (8) left the rest of the
run's `post` calls eager, silently. Compiled, a DTS run compiles as many graphs after its first steps as a
softmax-router run does, and trains as eager does."""

import copy

import pytest
import torch

from longctx.config import load_config
from longctx.models.compile import compile_token_wise_parts
from longctx.models.llama import build_model
from probes import loss_and_grads, packed_batch


def _moe_model(router: str):
    cfg = load_config(overrides=["--model.preset=debug-moe", "--model.layers=2", f"--model.moe.router={router}",
                                 "--model.moe.dts_steps=12"]).model
    return cfg, build_model(cfg, seed=1)


def _graphs_per_step(model, batch, steps: int, eager=None) -> list[int]:
    """Compiled graphs so far after each of `steps` training forwards + backwards, the router's step set before
    each as the trainer does; each step's loss and gradients checked against `eager` (the uncompiled model)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compile_token_wise_parts(model.layers)
    graphs = []
    for step in range(steps):
        for m in (model, eager):
            m.set_router_step(step)
        loss, grads = loss_and_grads(model, batch)
        ref_loss, ref_grads = loss_and_grads(eager, batch)
        # fp32 on CPU: inductor's fused kernels reorder sums (about 1e-7 relative); the routing is the same
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-5, msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


@pytest.mark.slow  # (about 20 s on a shared 2-core CPU, 90 s before the fix: inductor compiles the MoE block)
def test_dts_schedule_does_not_recompile_every_step():
    cfg, model = _moe_model("dts")
    batch = packed_batch(cfg)
    eager = copy.deepcopy(model)
    # steps 0-5 route to 8, 8, 7, 7, 6, 6 experts per token (8 - step / 2 rounded half up) at temperatures 2 to
    # 1.58: the first new count compiles once more (as a dynamic shape, which the second reuses); a new graph
    # every step is the bug
    graphs = _graphs_per_step(model, batch, 6, eager)
    compiling_steps = sum(after > before for before, after in zip(graphs, graphs[1:]))
    assert compiling_steps <= 1, f"compiled graphs after each step: {graphs}"


@pytest.fixture
def no_cpp_compiler():
    """inductor's C++ compiler search pointed at a compiler that does not exist (its search is cached: cleared).
    (inductor's own config.patch: monkeypatch's undo of a sub-config's attribute deletes it.)"""
    from torch._inductor import config
    from torch._inductor.cpp_builder import cpp_compiler_search

    cpp_compiler_search.cache_clear()
    with config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        yield
    cpp_compiler_search.cache_clear()


def test_no_cpp_compiler_is_a_clear_error_at_set_up(tmp_path, no_cpp_compiler):
    """A CPU without a C++ compiler cannot build inductor's kernels: the run stopped in its first step with
    inductor's InvalidCxxCompiler traceback, after the set-up; now one error before, saying what to set."""
    from longctx.errors import ConfigError
    from longctx.train.trainer import Trainer

    cfg = load_config(None, ["--model.layers=1", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=20",
                             "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
                             "--train.device=cpu", "--checkpoint.final=false", "--train.steps=1",
                             "--train.compile=true", f"--train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"train\.compile.*C\+\+ compiler.*--train\.compile=false"):
        Trainer(cfg, log=lambda *a, **k: None).run()


def test_compiling_leaves_the_state_dict_keys_alone():
    """Checkpoints and HF exports read the model's state dict: a compiled run's must name its tensors as an eager
    one's (no `_orig_mod.` of a compiled module), so either resumes the other (checked by hand: a run saved compiled
    resumed eager and the reverse give the uninterrupted eager run's losses to one float32 ulp)."""
    cfg = load_config(overrides=["--model.layers=2"]).model
    model = build_model(cfg, seed=1)
    before = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    compile_token_wise_parts(model.layers)  # (lazy: nothing is compiled until a forward)
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == before
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in build_model(cfg, seed=1).named_parameters()]
