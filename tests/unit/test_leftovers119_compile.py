"""Dynamo's recompile limit (8 compiles per code object) and the code longctx compiles:
- ops/eager.py eager_under_compile: its wrapper was ONE code object for every wrapped function, compiled by
  Dynamo as a frame of its own where a compiled caller broke its graph at it and guarded on each call's
  arguments: wrapped functions of 9 argument counts hit the limit (a "recompile limit" warning of a function
  meant never to compile), and a MoE model with a capacity under train.compile compiled it 6 times in its
  first step. Now nothing of a wrapper is compiled, guarded or counted;
- the compiled decode (models/static_decode.py, generate/blocks.py `next_token`): one code object per bucket
  held every sampling setting's graphs, and the 9th setting of a process (greedy; top-k, top-p, min-p each
  on or off) failed with FailOnRecompileLimitHit (fullgraph), as did the 5th model config of a process (a
  batch of 1 and of 2 each). A code object per variant now (model config, sampling branches); the rest of a
  code object's graphs (a batch of 1 then any; the first change of each sampling value) stays at most 6;
- every cache capacity a generation up to the model's max_seq_len can lease (56, 256 to 131072 slots) is one
  graph (the cache length is dynamic): inductor decodes across 12 of them with one compile, eager's tokens.

Dynamo's own records (torch._dynamo.utils.get_compilation_metrics; models/recompiles.py reads them for the
run's lines) and the warning torch logs at a limit hit are what is checked."""

import functools
import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import get_compilation_metrics

from longctx.config import load_config
from longctx.generate.cache_pool import capacity
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.models.compile import compile_token_wise_parts
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model, document_positions
from longctx.models.recompiles import RecompileWatch
from longctx.models.static_decode import CompiledStep, install
from longctx.ops.eager import eager_under_compile
from longctx.parallel.parallelize import apply_memory


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture()
def dynamo():
    """Fresh dynamo state and its records; the warnings torch logs (a recompile-limit hit is one)."""
    torch._dynamo.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    handler = _Warnings()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    torch._dynamo.reset()


def _limit_hits(handler) -> list:
    records = [r for r in get_compilation_metrics() if "recompile limit" in (r.fail_reason or "").lower()]
    return records + [line for line in handler.lines if "recompile_limit" in line or "recompile limit" in line]


seen = []


def _wrapped(i):
    def fn(x, *rest, **named):
        seen.append(torch.compiler.is_compiling())  # (traced: True; run eagerly: False)
        return x + i + len(rest) + 10 * len(named)
    return eager_under_compile(fn)


F = [_wrapped(i) for i in range(10)]


def _caller(x):
    """Ten wrapped functions, each called with its own arguments (counts, keywords, a non-tensor, a 2-d view)."""
    y = F[0](x * 2)
    y = F[1](y, y) * 1.5
    y = F[2](y, y, y) - 1
    y = F[3](y, a=1)
    y = F[4](y, y, a=1, b=2)
    y = F[5](y, 3, "text")
    y = F[6](y.view(2, 2)).view(4)
    y = F[7](y, y, y, y)
    y = F[8](y, c=y)
    return F[9](y, y, y, y, y) + 1


def test_wrapped_functions_of_many_signatures_compile_nothing_of_their_own(dynamo):
    x = torch.arange(4.0)
    seen.clear()
    expected = _caller(x)
    compiled = torch.compile(_caller, backend=CompileCounter())
    watch = RecompileWatch()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for _ in range(2):
                assert torch.equal(compiled(x), expected)
    assert seen and not any(seen)  # every wrapped call ran eagerly, never traced into a graph
    # before: ops/eager.py's `call` compiled 8 times, a limit hit at the 9th signature (and its warning)
    compiled_wrappers = [(r.co_name, r.co_filename) for r in get_compilation_metrics()
                         if r.co_name in ("call", "fn") or "ops/eager.py" in (r.co_filename or "")]
    assert compiled_wrappers == []
    assert _limit_hits(dynamo) == []
    # (the caller itself compiles again for grad mode: its own recompiles, not a wrapper's)
    assert [r for r in watch.take() if "eager.py" in r.function or "`call`" in r.function or r.limit_hit] == []


def test_a_moe_capacity_under_train_compile_compiles_no_wrapper(dynamo, monkeypatch):
    """The regional compile of a MoE model with a capacity (its routed rows eager: models/moe.py) and
    selective recompute in pieces: one training step compiles its parts and nothing of ops/eager.py (6 before)."""
    over = ["--model.preset=debug-moe", "--model.moe.capacity_factor=1.25", "--model.layers=2", "--model.dim=64",
            "--model.heads=4", "--model.kv_heads=2", "--model.ffn_dim=96", "--memory.recompute=selective",
            "--memory.block_chunk=8"]
    cfg = load_config(overrides=over)
    model = build_model(cfg.model, seed=3)
    apply_memory(model, cfg.memory, "cpu")
    counter = CompileCounter()
    with monkeypatch.context() as m:
        m.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
        compile_token_wise_parts(model.layers)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.model.vocab_size, (2, 67), generator=g) for _ in range(2))
    doc = torch.zeros(2, 67, dtype=torch.long)
    doc[0, 30:] = 1
    model(tokens, document_positions(doc), doc, labels=labels).backward()
    names = [r.co_name for r in get_compilation_metrics() if r.co_name]
    assert counter.frame_count > 0 and "post" in names  # (the compiled parts did compile)
    assert [n for n in names if n == "call"] == [] and _limit_hits(dynamo) == []


def _model(layers=1, **over):
    overrides = ["--model.preset=debug", f"--model.layers={layers}"] + [f"--model.{k}={v}" for k, v in over.items()]
    return build_model(load_config(overrides=overrides).model, seed=0).eval()


def _compiles_per_code_object() -> dict:
    out = {}
    for r in get_compilation_metrics():
        key = (r.co_name, str(r.compile_id).lstrip("!").split("/")[0])  # (dynamo's frame: one code object)
        out[key] = out.get(key, 0) + 1
    return out


def test_nine_sampling_settings_of_one_process_decode_compiled(dynamo):
    """Greedy and the 8 sampled branches (top-k, top-p, min-p each on or off), then new values of each
    sampling number and a batch of 2 in the all-filters variant, with and without logprobs: each generation's
    tokens eager's, no limit hit (before: FailOnRecompileLimitHit at the 9th setting), at most 6 graphs a code
    object (1, then 1 per sampling number's first change, 1 for a batch of 2). Here 2 at most: dynamo's
    automatic dynamic state is per function name and line, shared by the variants' copies, so the numbers the
    8 branches differ in were dynamic before the new values came; the batch of 2 compiled once more."""
    model = _model()
    step = CompiledStep(backend=CompileCounter())
    runs = [(Sampling(), 1)] + [(Sampling(temperature=0.8, top_k=k, top_p=p, min_p=m, seed=3), 1)
                                for k in (0, 20) for p in (1.0, 0.9) for m in (0.0, 0.05)]
    values = [(0.9, 20, 0.9, 0.05), (0.9, 30, 0.9, 0.05), (0.9, 30, 0.8, 0.05), (0.9, 30, 0.8, 0.1)]
    runs += [(Sampling(temperature=t, top_k=k, top_p=p, min_p=m, seed=3), 1) for t, k, p, m in values]
    runs += [(runs[-1][0], 2)]
    prompts = [[5, 6, 7], [8, 9]]
    for sampling, rows in runs:
        for logprobs in (None, 0):
            got, eager = ([r.tokens for r in generate(model, prompts[:rows], max_new_tokens=18, sampling=sampling,
                                                      logprobs=logprobs, compile=compile)]
                          for compile in (step, None))
            assert got == eager, (sampling, rows, logprobs)
    assert _limit_hits(dynamo) == []
    per_code = _compiles_per_code_object()
    assert len(per_code) == 18 and max(per_code.values()) <= 6, per_code  # 9 variants x logprobs; the bound


def test_five_model_configs_of_one_process_decode_compiled(dynamo):
    """Models of 1 to 5 layers, each decoding a batch of 1 then of 2: eager's tokens, 2 graphs a model (before:
    one code object for all, a batch of 1 and any other per model, FailOnRecompileLimitHit at the 9th graph)."""
    step = CompiledStep(backend=CompileCounter())
    for layers in range(1, 6):
        model = _model(layers)
        for rows in (1, 2):
            prompts = [[5, 6, 7], [8, 9]][:rows]
            got, eager = ([r.tokens for r in generate(model, prompts, max_new_tokens=6, compile=compile)]
                          for compile in (step, None))
            assert got == eager, (layers, rows)
    assert _limit_hits(dynamo) == [] and sorted(_compiles_per_code_object().values()) == [2] * 5


def test_inductor_decodes_across_the_capacities_up_to_max_seq_len_with_one_graph(dynamo):
    """12 cache capacities (generate/cache_pool.py, 256 to the model's max_seq_len 131072 slots): each decodes
    3 tokens through the compiled step (inductor) as the eager path does, and the step compiles once."""
    model = _model()
    top = model.cfg.max_seq_len
    lengths = sorted({capacity(n) for n in (200, 600, 900, 1500, 2100, 3000, 5000, 9000, 17000, 33000, 70000, top)})
    assert len(lengths) > 8 and lengths[-1] == top
    step = CompiledStep()
    with torch.inference_mode():
        for length in lengths:
            tokens = []
            for fast in (False, True):
                cache = KVCache.for_model(model, 1, length)
                logits = model(torch.tensor([[5, 6, 7]]), cache=cache)
                if fast:
                    assert install(cache, model, step)
                out = []
                for _ in range(3):
                    out.append(logits[:, -1].argmax(-1))
                    logits = model(out[-1][:, None], cache=cache)
                tokens.append(torch.cat(out).tolist())
            assert tokens[0] == tokens[1], length
    assert step.calls == 3 * len(lengths)
    assert _compiles_per_code_object() == {("static_hidden_states_1", "0"): 1} and _limit_hits(dynamo) == []
