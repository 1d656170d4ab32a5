"""The Trainer's step hooks, the fault wrapper and the model builder table (issue 48 item 4):
hooks are called in order and combined; a dense run (or a GliDe draft) installs no MoE hook; the
step is wrapped only when LONGCTX_FAULT plans a step fault, each fault fires once, and the wrapper
leaves no hook on the model; the hang runs before any other forward pre-hook (FSDP's all-gather);
trainer.py holds no MoE or fault code, and glide.py no longer imports model.py."""

import ast
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import longctx.train.fault_injection as fault_injection
from longctx.config import load_config
from longctx.faults import SPIKE_MULTIPLIER
from longctx.models.llama import build_model
from longctx.train.fault_injection import FaultyStep, with_step_faults
from longctx.train.hooks import StepHook, StepHooks
from longctx.train.model import MODEL_BUILDERS, build_glide_training, build_llama_training, model_kind
from longctx.train.moe_hooks import MoEStepHook, moe_step_hooks

TRAIN = Path(__file__).resolve().parents[2] / "src" / "longctx" / "train"


class _Recording(StepHook):
    def __init__(self, name, calls, term=None, fields=None, note=None):
        self.name, self.calls, self.term, self.fields, self.note = name, calls, term, fields or {}, note

    def step_start(self, step):
        self.calls.append((self.name, "step_start", step))

    def after_forward(self, micro_batches, scale):
        self.calls.append((self.name, "after_forward", micro_batches, scale))
        return self.term

    def log_fields(self, step, last):
        return self.fields

    def eval_note(self):
        return self.note


def test_hooks_run_in_order_and_their_results_combine():
    calls = []
    a = _Recording("a", calls, term=torch.tensor(1.0), fields={"x": 1, "y": 2}, note="routed")
    b = _Recording("b", calls, fields={"y": 3})
    hooks = StepHooks([a, b, StepHook()])
    hooks.step_start(4)
    terms = hooks.after_forward(2, 0.5)
    assert [c[:2] for c in calls] == [("a", "step_start"), ("b", "step_start"), ("a", "after_forward"),
                                      ("b", "after_forward")]
    assert len(terms) == 1 and terms[0].item() == 1.0  # (a hook without a term adds none)
    assert hooks.log_fields(4, last=False) == {"x": 1, "y": 3}  # later hooks' fields after earlier ones
    assert hooks.eval_note() == "routed" and StepHooks([]).eval_note() is None
    assert hooks.find(_Recording) is a and hooks.find(MoEStepHook) is None
    hooks.after_optimizer(4, torch.tensor(True))  # (the base hook's points do nothing)
    hooks.rolled_back()
    hooks.run_end()


def _cfg(*extra):
    return load_config("configs/debug.toml", ["--train.steps=10", *extra])


def test_only_a_run_that_trains_routers_installs_the_moe_hook():
    rt = SimpleNamespace(dims=SimpleNamespace(expert=1))
    dense = _cfg()
    assert model_kind(dense) == "dense" and moe_step_hooks(dense, None, rt) == []
    moe = _cfg("--model.preset=debug-moe", "--model.moe.bias_update_rate=0.01")
    model = build_model(moe.model)
    (hook,) = moe_step_hooks(moe, model, rt)
    assert model_kind(moe) == "moe" and isinstance(hook, MoEStepHook)
    assert hook.router_counts is None and len(hook.interval.bias_layers) == len(moe.model.moe_layer_ids)
    # a GliDe draft trained against an MoE target trains no routers
    draft = dataclasses.replace(moe, draft=dataclasses.replace(moe.draft, target="/some/target"))
    assert model_kind(draft) == "glide" and moe_step_hooks(draft, model, rt) == []


def test_the_model_builders_are_a_table():
    assert MODEL_BUILDERS == {"dense": build_llama_training, "moe": build_llama_training,
                              "glide": build_glide_training}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_glide_does_not_import_the_model_builders():
    """model.py imports glide.py for the table; glide.py must not import model.py back (no circle)."""
    assert ".glide" in _imports(TRAIN / "model.py")
    assert not {".model", "longctx.train.model"} & _imports(TRAIN / "glide.py")


def test_the_trainer_holds_no_moe_or_fault_code():
    """No name of the routers' bookkeeping or of fault injection in trainer.py's code or its step's (step_run.py;
    docstrings aside)."""
    names = set()
    code = [ast.parse((TRAIN / f).read_text()) for f in ("trainer.py", "step_run.py")]
    for node in (n for tree in code for n in ast.walk(tree)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name)
    assert "forward_loss_sum" in names and "with_step_faults" in names  # (the check sees the code)
    assert not names & {"router_terms", "update_expert_bias", "set_router_step", "expert_step_notes",
                        "RouterInterval", "layer_loads", "heatmap_every", "moe_layers", "eval_routing_note",
                        "hang_forever", "planned", "SPIKE_MULTIPLIER", "faults", "_inject"}


class _LossModel(torch.nn.Module):
    def forward(self, x):
        return (x * 2.0).sum()


def test_without_a_planned_step_fault_the_step_is_not_wrapped(monkeypatch):
    model = _LossModel()

    def step(s):
        return model(torch.ones(3))

    monkeypatch.delenv("LONGCTX_FAULT", raising=False)
    assert with_step_faults(step, model, rank=0) is step
    monkeypatch.setenv("LONGCTX_FAULT", "enospc@1,hang@1:2")  # (a save's fault, and a hang of another rank)
    assert with_step_faults(step, model, rank=0) is step


def test_each_fault_fires_once_and_leaves_no_hook(monkeypatch):
    model = _LossModel()
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@2,spike@3")
    wrapped = with_step_faults(lambda s: model(torch.ones(3)), model, rank=0)
    assert isinstance(wrapped, FaultyStep)
    first = [wrapped(s).item() for s in (1, 2, 3)]
    assert first[0] == 6.0 and math.isnan(first[1]) and first[2] == 6.0 * SPIKE_MULTIPLIER
    assert not model._forward_hooks and not model._forward_pre_hooks
    again = [wrapped(s).item() for s in (2, 3)]  # run again after a rollback: not hit again
    assert again == [6.0, 6.0]


def test_a_step_that_raises_keeps_its_fault_and_leaves_no_hook(monkeypatch):
    model = _LossModel()
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@2")
    calls = []

    def step(s):
        calls.append(s)
        loss = model(torch.ones(3))
        if len(calls) == 1:
            raise RuntimeError("a crash inside the step")
        return loss

    wrapped = with_step_faults(step, model, rank=0)
    with pytest.raises(RuntimeError):
        wrapped(2)
    assert not model._forward_hooks
    assert math.isnan(wrapped(2).item())  # (the step never completed: its fault is still planned)


def test_a_hang_comes_before_every_other_forward_pre_hook(monkeypatch):
    """As FSDP's pre-forward (its all-gather) would: the hung rank never joins the collective."""
    model, order = _LossModel(), []
    model.register_forward_pre_hook(lambda *_: order.append("fsdp"), prepend=True)

    class Hung(Exception):
        pass

    def hang():
        order.append("hang")
        raise Hung

    monkeypatch.setattr(fault_injection, "hang_forever", hang)
    monkeypatch.setenv("LONGCTX_FAULT", "hang@0:2")
    wrapped = with_step_faults(lambda s: model(torch.ones(3)), model, rank=0)
    wrapped(1)
    assert order == ["fsdp"]
    with pytest.raises(Hung):
        wrapped(2)
    assert order == ["fsdp", "hang"]
    assert len(model._forward_pre_hooks) == 1  # (the wrapper's own removed, even on the way out of an error)


def test_the_moe_hook_counts_each_steps_expert_placement():
    """expert_rank_load follows the placement the step ran under (layer.experts.placement), and the
    static figure when no layer has one."""
    from longctx.models.moe import moe_layers
    from longctx.parallel.expert.placement import plan_placement

    cfg = _cfg("--model.preset=debug-moe")
    model = build_model(cfg.model)
    (hook,) = moe_step_hooks(cfg, model, SimpleNamespace(dims=SimpleNamespace(expert=2)))
    layers, experts = len(cfg.model.moe_layer_ids), cfg.model.moe_experts
    counts = torch.ones(layers, experts)
    counts[:, 0] = 3 * experts  # expert 0 hot: rank 0 runs most of the rows
    for layer in moe_layers(model):
        layer.experts.placement = None
    assert hook._placement_shares(counts) is None  # (the static placement: rank_load's own blocks)
    planned = plan_placement(counts[0].tolist(), 2, 1)
    for layer in moe_layers(model):
        layer.experts.placement = planned
    hook._step = SimpleNamespace(counts=counts, rows=counts, stats=torch.zeros(5), layer_load=torch.ones(layers),
                                 dropped=None)
    hook.model = SimpleNamespace(update_expert_bias=lambda c: None, modules=model.modules)
    hook.after_optimizer(1, torch.tensor(True))
    assert hook.log_fields(1, last=True)["expert_rank_load"] == pytest.approx(planned.predicted["max_over_mean_after"])


def test_a_step_not_applied_leaves_the_placer_the_last_applied_steps_counts():
    """FlexMoE's placer reads hook.router_counts at the next step: a skipped step's choices (a NaN forward's are
    no routing) must not replace those of the last step whose update was applied."""
    cfg = _cfg("--model.preset=debug-moe")
    model = build_model(cfg.model)
    (hook,) = moe_step_hooks(cfg, model, SimpleNamespace(dims=SimpleNamespace(expert=1)))
    layers, experts = len(cfg.model.moe_layer_ids), cfg.model.moe_experts
    hook.model = SimpleNamespace(update_expert_bias=lambda c: None, modules=model.modules)
    good, bad = torch.full((layers, experts), 2.0), torch.zeros(layers, experts)
    bad[:, 0] = 99.0
    for counts, applied in ((good, True), (bad, False)):
        hook._step = SimpleNamespace(counts=counts, rows=counts, stats=torch.zeros(5), layer_load=torch.ones(layers),
                                     dropped=None)
        hook.after_optimizer(1, torch.tensor(applied))
    assert torch.equal(hook.router_counts, good)


def test_counts_restored_on_another_device_than_the_steps_are_taken_over():
    """load_state_dict puts a checkpoint's counts on the parameters' device: the host under memory.model_states =
    host, while a step's counts and its applied flag are on the GPU; the first step after a resume or rollback
    then failed in after_optimizer's torch.where (devices mixed). Here the step's are on the meta device."""
    cfg = _cfg("--model.preset=debug-moe")
    model = build_model(cfg.model)
    (hook,) = moe_step_hooks(cfg, model, SimpleNamespace(dims=SimpleNamespace(expert=1)))
    layers, experts = len(cfg.model.moe_layer_ids), cfg.model.moe_experts
    hook.load_state_dict({"router_counts": [[1.0] * experts] * layers, "placer": None})  # (on the CPU)
    hook.model = SimpleNamespace(update_expert_bias=lambda c: None, modules=model.modules)
    counts = torch.empty(layers, experts, device="meta")
    hook._step = SimpleNamespace(counts=counts, rows=counts, stats=torch.zeros(5, device="meta"),
                                 layer_load=torch.ones(layers, device="meta"), dropped=None)
    hook.after_optimizer(1, torch.zeros((), dtype=torch.bool, device="meta"))
    assert hook.router_counts.device == counts.device and hook.router_counts.shape == (layers, experts)


def test_counts_are_restored_where_the_steps_are_made_not_with_the_parameters():
    """Under memory.model_states = host on a GPU the parameters are in host memory and the buffers on the device
    (parallel/fsdp/shard.py materialize), where a step's counts are made: restored with the parameters, the first
    step after a resume or rollback copied them to the device in after_optimizer, a copy that waits for the GPU
    (tests/distributed/test_host_tier_origins.py). "meta" stands in for the device, as in
    test_host_states_materialize.py."""
    from longctx.parallel.fsdp.shard import materialize

    cfg = _cfg("--model.preset=debug-moe", "--memory.model_states=host")
    model = build_model(cfg.model, device="meta")
    materialize(model, cfg, torch.device("meta"))  # parameters on the CPU, buffers on "meta"
    (hook,) = moe_step_hooks(cfg, model, SimpleNamespace(dims=SimpleNamespace(expert=1)))
    layers, experts = len(cfg.model.moe_layer_ids), cfg.model.moe_experts
    hook.load_state_dict({"router_counts": [[1.0] * experts] * layers, "placer": None})
    assert hook.router_counts.device.type == "meta"
