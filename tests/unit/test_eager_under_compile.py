"""ops/eager.py: eager_under_compile runs a function eagerly inside a torch.compile'd caller (what
torch.compiler.disable does), and importing longctx's modules no longer imports torch._dynamo."""

import subprocess
import sys

import torch

from longctx.ops.eager import eager_under_compile

seen = []


@eager_under_compile
def _records_whether_traced(x):
    seen.append(torch.compiler.is_compiling())  # traced by Dynamo: True; run eagerly: False
    return x * 2


def _plain(x):
    seen.append(torch.compiler.is_compiling())
    return x * 2


def test_an_eager_call_is_the_plain_function():
    seen.clear()
    assert torch.equal(_records_whether_traced(torch.ones(3)), torch.full((3,), 2.0))
    assert seen == [False] and _records_whether_traced.__name__ == "_records_whether_traced"


def test_under_compile_it_runs_eagerly_on_every_call():
    torch._dynamo.reset()

    def caller(fn):
        return torch.compile(lambda x: fn(x + 1) - 1, backend="eager")

    seen.clear()
    wrapped = caller(_records_whether_traced)
    out = [wrapped(torch.ones(3)) for _ in range(2)]
    assert all(torch.equal(o, torch.full((3,), 3.0)) for o in out)
    assert seen == [False, False]  # eager each call: never traced into the graph
    seen.clear()
    plain = caller(_plain)  # the check can fail: an undecorated function is traced (and its append replayed)
    [plain(torch.ones(3)) for _ in range(2)]
    assert seen and all(seen)


def test_importing_the_cli_models_and_memory_does_not_import_dynamo():
    code = ("import sys, longctx.cli, longctx.models.llama, longctx.models.moe, longctx.memory.apply_policy, "
            "longctx.ops.grouped, longctx.generate.cli, longctx.eval.command; print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
