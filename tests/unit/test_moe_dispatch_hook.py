"""The MoE layer's dispatch hook (models/moe_dispatch.py): the layer runs dispatch -> experts ->
combine through the object in `layer.dispatcher`, the one-device one keeps no state of a call, and
no file of parallel/ installs a parallelism by replacing a module's method (DESIGN principle 15:
the expert-parallel dispatcher is an object set on the layer, parallel/expert/install.py)."""

import ast
import copy
from pathlib import Path

import torch

from longctx.config import ModelConfig
from longctx.models.moe import MoEFeedForward
from longctx.models.moe_dispatch import TokenDispatcher

SRC = Path(__file__).resolve().parents[2] / "src" / "longctx"
PATCHED = {"forward", "route_tokens"}  # module methods a parallelism once overwrote


class _Recording(TokenDispatcher):
    def __init__(self):
        self.calls = []

    def dispatch(self, flat, routing):
        self.calls.append("dispatch")
        return super().dispatch(flat, routing)

    def run_experts(self, experts, rows, counts):
        self.calls.append(("run_experts", int(counts.sum())))
        return super().run_experts(experts, rows, counts)

    def combine(self, out, state):
        self.calls.append("combine")
        return super().combine(out, state)


def _layer(capacity: float = 0.0) -> MoEFeedForward:
    cfg = ModelConfig(dim=16, ffn_dim=32, moe_experts=4, moe_top_k=2, moe_expert_dim=24,
                      moe_capacity_factor=capacity)
    layer = MoEFeedForward(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer


def test_the_layer_runs_through_the_dispatcher_it_holds():
    for capacity in (0.0, 1.0):  # dropless, and with a capacity's dropped choices
        layer = _layer(capacity)
        other = copy.deepcopy(layer)
        other.dispatcher = recording = _Recording()
        x = torch.randn(2, 11, 16)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = layer(xa), other(xb)
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
        assert recording.calls[0] == "dispatch" and recording.calls[-1] == "combine"
        assert recording.calls[1][0] == "run_experts" and recording.calls[1][1] <= 44  # T x k rows at most


def test_one_dispatcher_serves_several_layers_and_keeps_no_call_state():
    first, second = _layer(), _layer()
    shared = TokenDispatcher()
    a, b = copy.deepcopy(first), copy.deepcopy(second)
    a.dispatcher = b.dispatcher = shared
    x = torch.randn(9, 16)
    assert torch.equal(a(x), first(x)) and torch.equal(b(a(x)), second(first(x)))
    assert vars(shared) == {}


def _method_assignments(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        lines += [t.lineno for t in targets if isinstance(t, ast.Attribute) and t.attr in PATCHED]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in PATCHED):
            lines.append(node.lineno)
    return lines


def test_parallel_overwrites_no_module_method():
    found = [f"{path.relative_to(SRC)}:{line}" for path in sorted((SRC / "parallel").rglob("*.py"))
             for line in _method_assignments(ast.parse(path.read_text()))]
    assert found == []


def test_the_check_catches_a_patched_forward():
    planted = "import functools\nexperts.forward = functools.partial(run, mesh=mesh)\nsetattr(m, 'route_tokens', f)\n"
    assert _method_assignments(ast.parse(planted)) == [2, 3]


def test_a_call_with_no_token_returns_no_rows():
    """A rank whose share of a batch holds no token (a data-parallel degree above the batch's rows) runs the
    layer on zero tokens: combine's view(0, k, -1) raised ("ambiguous"); dropless and capacity alike."""
    for capacity in (0.0, 1.0):
        layer = _layer(capacity)
        x = torch.randn(1, 0, 16, requires_grad=True)
        y = layer(x)
        y.sum().backward()
        assert y.shape == (1, 0, 16) and x.grad.shape == (1, 0, 16)
