"""train.compile with a MoE capacity (moe.capacity_factor > 0): the compiled parts compile in the first step only.

A capacity keeps a data-dependent number of routed rows (the dispatch reads it on the host), and the compiled
functions the rows reached guarded on it, each guard failing at a step after the first: the count itself (compiled
static where step 1's calls all kept the same: `___stack0 == 265`), a count of 0 or 1 (dynamo assumes a dynamic
size >= 2: `2 <= x.size()[0]`, a piece of memory.block_chunk keeping 0 or 1 rows; torch.compile(dynamic=True)
compiled again the same), and whether any row was dropped (`state.rows < 2*state.weights.size()[0]`, the combine's
branch, and TokenRows' backward's). So a run said "compiled again at step N" after its warm-up. The rows now run
eagerly under compile (models/moe.py `_kept_experts_of`); without a capacity they are T x k, a shape of the call,
and stay compiled.

Counted with a counting backend (dynamo's guards and recompiles are the backend's whatever it is): seconds, not
inductor's minutes; tests/unit/test_compile_fuzz118.py (slow) runs MoE with a capacity under inductor against eager."""

import copy
import functools
import json

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from longctx.config import load_config
from longctx.models.compile import compile_token_wise_parts
from longctx.models.llama import build_model, document_positions
from longctx.parallel.parallelize import apply_memory
from longctx.train.trainer import Trainer

SMALL = ["--model.layers=2", "--model.dim=64", "--model.heads=4", "--model.kv_heads=2", "--model.ffn_dim=96",
         "--memory.recompute=selective"]
MOE = ["--model.preset=debug-moe"]  # (its layer 0 dense: `post` compiles for both kinds of feed-forward)
CAPACITY = [*MOE, "--model.moe.capacity_factor=1.25"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # (earlier tests' compiles neither count nor use up the recompile limit)
    yield
    torch._dynamo.reset()


def _graphs_per_step(monkeypatch, over: list[str], steps: int = 3, seq: int = 67):
    """(graphs compiled by the end of each step, the compiled model's losses, an eager copy's losses): SGD steps of
    the same packed batch (two rows, 67 tokens: block_chunk 8 leaves a last piece of 3)."""
    cfg = load_config(overrides=[*SMALL, *over])
    model = build_model(cfg.model, seed=3)
    apply_memory(model, cfg.memory, "cpu")  # (the trainer's order: the memory policy, then the compiled parts)
    eager = copy.deepcopy(model)
    counter = CompileCounter()
    with monkeypatch.context() as m:
        m.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
        compile_token_wise_parts(model.layers)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.model.vocab_size, (2, seq), generator=g) for _ in range(2))
    doc = torch.zeros(2, seq, dtype=torch.long)
    doc[0, 30:] = 1  # (two documents in a row)
    graphs, losses, eager_losses = [], [], []
    for m, out in ((model, losses), (eager, eager_losses)):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)  # (large: the routing, and the kept rows, move)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = m(tokens, document_positions(doc), doc, labels=labels)
            loss.backward()
            optimizer.step()
            out.append(float(loss.detach()))
            if m is model:
                graphs.append(counter.frame_count)
    return graphs, losses, eager_losses


@pytest.mark.parametrize("over", [[*CAPACITY, "--memory.block_chunk=8"], CAPACITY,
                                  [*CAPACITY, "--model.moe.top_k=1", "--model.dim=128", "--memory.block_chunk=7"]],
                         ids=["capacity-block_chunk", "capacity", "capacity-top1-block_chunk"])
def test_a_moe_capacity_compiles_in_the_first_step_only(monkeypatch, over):
    # before: [33, 35, 35] in pieces (step 2: the drop / no-drop branches); [18, 24, 24] without (step 1's two
    # layers kept 265 rows each: graphs static in the count, step 2's 254 compiled them again); [41, 49, 49] top-1
    # in pieces of 7 (step 2's pieces kept 1 and 0 rows: `2 <= x.size()[0]`)
    graphs, losses, eager = _graphs_per_step(monkeypatch, over)
    assert graphs[0] > 0, "nothing compiled: the test compared eager with eager"
    assert graphs == [graphs[0]] * 3, f"compiled after step 1: graphs by the end of each step {graphs}"
    assert losses == pytest.approx(eager, rel=1e-5)


@pytest.mark.parametrize("over,graphs", [([], [2, 2, 2]), (["--memory.block_chunk=8"], [4, 4, 4])],
                         ids=["dense", "dense-block_chunk"])
def test_dense_compiles_as_before(monkeypatch, over, graphs):
    """`pre` and `post` once each, shared by the blocks; a last shorter piece once more each (a dynamic token
    count), all in step 1 (models/compile.py's docstring)."""
    assert _graphs_per_step(monkeypatch, over)[0] == graphs


def test_a_dropless_moe_in_pieces_compiles_in_the_first_step_only(monkeypatch):
    graphs, losses, eager = _graphs_per_step(monkeypatch, [*MOE, "--memory.block_chunk=8"])
    assert graphs[0] > 4 and graphs == [graphs[0]] * 3, graphs  # (its routed rows compiled: more than dense's)
    assert losses == pytest.approx(eager, rel=1e-5)


def test_a_run_with_a_capacity_says_no_recompile(tmp_path, monkeypatch):
    """The run's own notice (train/recompile_hook.py), which said before: "train.compile: 12 functions compiled
    again at step 3 (25 compiles: `torch_dynamo_resume_in_dispatch_at_134` (models/moe_dispatch.py:134), ..."."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    cfg = load_config(None, [*CAPACITY, "--memory.recompute=selective", "--memory.block_chunk=20",
                             "--train.seq_len=64", "--train.global_batch=4", "--data.max_docs=80",
                             "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
                             "--train.device=cpu", "--checkpoint.interval=0", "--checkpoint.final=false",
                             "--train.steps=3", "--train.warmup_steps=1", "--metrics.log_interval=1",
                             "--train.compile=true", f"--train.run_dir={tmp_path / 'run'}"])
    lines = []
    Trainer(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a)))).run()
    assert [x for x in lines if x.startswith("train.compile")] == []
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["compile_recompiles"] for r in records if r["kind"] == "train"] == [0, 0, 0]
