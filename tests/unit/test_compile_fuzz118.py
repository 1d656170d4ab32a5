"""A randomized audit of the compiled paths (real inductor, CPU) against eager, what the docs promise:

1. `train.compile` (models/compile.py: each block's `pre` and `post` compiled, after the memory policy, as
   parallel/parallelize.py orders them): random small models (dense, GQA, MQA, MoE; a random width, a sequence
   length that is no multiple of 8, three packed documents per row at random cuts, random ignored labels) under
   the memory policies the trainer combines with it (docs/memory.md: selective or full recompute, their host
   offload, block_chunk, attention_chunk with attention_offload, loss_chunk, expert_chunk; a MoE capacity, whose
   routing is decided before the pieces run). Three SGD steps, each compared with the eager copy's: the loss within
   1e-6 relative, every gradient within 1e-5 of that gradient's largest magnitude (fp32: inductor's fused kernels
   reorder sums; measured <= 1.5e-6 of it, and the losses equal to the bit). The compiled code must have run
   (graphs compiled in step 1), no function reaches dynamo's recompile limit, and nothing compiles after the
   warm-up (step 1; a capacity's data-dependent expert rows run eagerly): a compile per step is the recompile
   docs/running.md "train.compile: recompiles" warns of.
2. The compiled decode step (models/static_decode.py, generate(..., compile=...), docs/generate.md "A compiled
   decode step"), set up as `longctx generate --compile` does (generate/cli.py `_warm_up`, `_note_recompiles`):
   greedy tokens equal to eager's bitwise, batch 1 and 3 of ragged prompts, one generation past the cache pool's
   first capacity (256 slots -> 512: another cache length), logprobs within fp32 rounding (1e-5) and the same top
   ids; seeded sampling (several samples per prompt) and penalties the same tokens; speculative decoding (a chain
   of K = 3 with a confidence stop, a CaPE tree, seeded sampling: buckets 1 to 8) the same tokens with compile as
   without (greedy: and as plain greedy). Every decode step goes through the step, and `compile_recompiles` is 0
   after the warm-up on every result.
Slow (inductor compiles every graph on the CPU: minutes on a loaded 2-core machine, ~30 s once inductor's FX
graph cache holds them). Each test draws from its own seeded generator, so a failure reruns as it was."""

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from longctx.config import load_config
from longctx.generate import cli
from longctx.generate.cape import CapeTable
from longctx.generate.drafters import ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.local import LOCAL
from longctx.generate.sampling import Sampling
from longctx.generate.speculative import speculative_generate, warm_up
from longctx.models.compile import compile_token_wise_parts
from longctx.models.llama import build_model, document_positions
from longctx.models.recompiles import RecompileWatch
from longctx.models.static_decode import CompiledStep
from longctx.parallel.parallelize import apply_memory

pytestmark = pytest.mark.slow

RNG = random.Random(118)
LOSS_REL, GRAD_REL, LOGPROB_TOL = 1e-6, 1e-5, 1e-5

# (model, memory policy): every policy kind the trainer applies before compiling, each model kind at least once
TRAIN_CASES = [
    ("dense", []),
    ("gqa", ["--memory.recompute=selective", "--memory.offload_fraction=0.5",
             f"--memory.block_chunk={RNG.choice([13, 19])}"]),
    ("mqa", ["--memory.recompute=full", "--memory.offload_fraction=1.0",
             f"--memory.attention_chunk={RNG.choice([11, 17])}", "--memory.attention_offload=true"]),
    # (a capacity: routing decided over every token before the pieces run, docs/memory.md; 9 or more pieces per
    # block: past dynamo's recompile limit if each piece compiled its own graph, as the router record once made it)
    ("moe", ["--memory.recompute=selective", f"--memory.block_chunk={RNG.choice([7, 8])}",
             f"--memory.loss_chunk={RNG.choice([29, 37])}", "--memory.expert_chunk=24"]),
]

def _train_model(rng: random.Random, kind: str, memory: list[str], seed: int):
    heads = rng.choice([4, 8])
    kv = {"dense": heads, "gqa": 2, "mqa": 1, "moe": 2}[kind]
    over = ["--model.layers=2", f"--model.dim={rng.choice([64, 128])}", f"--model.heads={heads}",
            f"--model.kv_heads={kv}", f"--model.ffn_dim={rng.choice([96, 160])}"]
    if kind == "moe":
        over = ["--model.preset=debug-moe", *over, f"--model.moe.top_k={rng.choice([1, 2])}",
                "--model.moe.expert_dim=64", "--model.moe.capacity_factor=1.25"]
    cfg = load_config(overrides=over + memory)
    return cfg, build_model(cfg.model, seed=seed)


def _packed(vocab: int, seq: int, seed: int):
    """tokens, positions, document ids, labels: three documents per row at random cuts, ~10% labels ignored."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    labels = torch.randint(0, vocab, (2, seq), generator=g)
    labels[torch.rand(2, seq, generator=g) < 0.1] = -100
    doc = torch.zeros(2, seq, dtype=torch.long)
    for r in range(2):
        a, b = sorted(torch.randperm(seq - 2, generator=g)[:2].add(1).tolist())
        doc[r, a:], doc[r, b:] = 1, 2
    return tokens, document_positions(doc), doc, labels


def _step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    loss = model(*batch[:3], labels=batch[3])
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,memory", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_compile_matches_eager_step_by_step(kind, memory):
    torch._dynamo.reset()  # (pre and post are one code object for every model: each case compiles its own)
    counters = torch._dynamo.utils.counters
    counters.clear()
    rng = _rng(kind)
    seed, seq = rng.randrange(1000), rng.choice([67, 75] if kind == "moe" else [45, 53, 61, 67, 75])
    cfg, compiled = _train_model(rng, kind, memory, seed)
    eager = copy.deepcopy(compiled)
    for m in (compiled, eager):  # the trainer's order: the memory policy, then the compiled parts
        apply_memory(m, cfg.memory, "cpu")
    compile_token_wise_parts(compiled.layers)
    batch = _packed(cfg.model.vocab_size, seq, seed)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (compiled, eager)]
    watch, graphs = RecompileWatch(), []
    for step in (1, 2, 3):
        (loss, grads), (ref_loss, ref_grads) = (_step(m, o, batch) for m, o in zip((compiled, eager), optimizers))
        graphs.append(counters["stats"]["unique_graphs"])
        assert loss == pytest.approx(ref_loss, rel=LOSS_REL), f"step {step}"
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            bound = GRAD_REL * float(ref.abs().max().clamp_min(1e-6))
            torch.testing.assert_close(grads[name], ref, rtol=0, atol=bound,
                                       msg=lambda m, s=step, n=name: f"step {s} {n}: {m}")
        for o in optimizers:
            o.step()
    assert graphs[0] >= 2, f"the compiled parts never compiled (graphs {graphs}): the audit compared eager with eager"
    # nothing compiles after step 1: a MoE capacity's data-dependent rows run eagerly (models/moe.py
    # _kept_experts_of; until 2026-12-07 step 2 compiled them again)
    assert graphs[2] == graphs[0], f"compiled after the warm-up (graphs after each step {graphs}): {watch.take()}"
    assert not [r for r in watch.take() if r.limit_hit]


# --- the compiled decode step ---------------------------------------------------------------------------------

def _rng(name: str) -> random.Random:
    """Each test's own generator (seeded by its name): a test run alone draws what it draws in the file."""
    return random.Random(f"118-{name}")


def _prompts(rng: random.Random, lengths) -> list[list[int]]:
    return [[rng.randrange(320) for _ in range(rng.randint(*span))] for span in lengths]


@pytest.fixture(scope="module")
def target():
    """The debug model (2 layers; GQA or MQA) at init_std 0.2: at the default 0.02 its greedy tokens fell into a
    2-cycle that barely depends on the context, and a speculative run passed with every new key written one slot
    off; at 0.2 a token's context decides it (checked: another prompt or one more leading token changes every
    continuation's tokens)."""
    torch._dynamo.reset()
    rng = _rng("target")
    cfg = load_config(overrides=["--model.layers=2", f"--model.kv_heads={rng.choice([1, 2])}",
                                 "--model.init_std=0.2"]).model
    model = build_model(cfg, seed=rng.randrange(1000)).eval()
    prompt = _prompts(rng, [(30, 30)])[0]
    same, shifted = (generate(model, [p], max_new_tokens=12)[0].tokens for p in (prompt, [7] + prompt))
    assert sum(a != b for a, b in zip(same, shifted)) > 6, "the audit's model barely reads its context"
    return model


def _cli_warm_up(model, prompts, batch: int, sampling: Sampling, logprobs, samples: int = 1):
    """`longctx generate --compile`'s warm-up of a run of `prompts` in batches of `batch`: its step."""
    request = SimpleNamespace(prompts=[{"ids": p} for p in prompts], sampling=sampling)
    args = SimpleNamespace(compile=True, batch=batch, draft=None, num_samples=samples, logprobs=logprobs)
    step = cli._warm_up(request, args, model, torch.device("cpu"), LOCAL, False)
    assert step and step.calls > 0, "the warm-up ran no compiled step"
    return step


def _run_like_the_cli(model, prompts, limits, batch: int, sampling: Sampling, logprobs=None, samples: int = 1):
    """(eager results, compiled results) of the run in batches of `batch` after the CLI's warm-up, each compiled
    result's compile_recompiles set as the CLI sets it; every decode step checked to go through the step."""
    step = _cli_warm_up(model, prompts, batch, sampling, logprobs, samples)
    watch, eager, compiled = RecompileWatch(), [], []
    for start in range(0, len(prompts), batch):
        kw = dict(max_new_tokens=limits[start:start + batch], sampling=sampling, logprobs=logprobs,
                  num_samples=samples)
        eager += generate(model, prompts[start:start + batch], **kw)
        calls = step.calls
        results = generate(model, prompts[start:start + batch], compile=step, **kw)
        assert step.calls - calls == max(limits[start:start + batch]) - 1, "a decode step ran eagerly"
        cli._note_recompiles(watch, results, start, False)
        compiled += results
    assert [r.compile_recompiles for r in compiled] == [0] * len(compiled)
    return eager, compiled


def _same_logprobs(eager, compiled):
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), rtol=LOGPROB_TOL,
                                   atol=LOGPROB_TOL)
        if e.top_logprobs is not None:
            assert [[i for i, _ in t] for t in c.top_logprobs] == [[i for i, _ in t] for t in e.top_logprobs]
            torch.testing.assert_close(torch.tensor([[x for _, x in t] for t in c.top_logprobs]),
                                       torch.tensor([[x for _, x in t] for t in e.top_logprobs]),
                                       rtol=LOGPROB_TOL, atol=LOGPROB_TOL)


@pytest.mark.parametrize("logprobs", [None, 2], ids=["block-graph", "logprobs"])
def test_greedy_decoding_is_eager_bitwise(target, logprobs):
    """Without logprobs a block of steps runs as a BlockGraph, with them step by step keeping the logits
    (generate/blocks.py): batches of 3 ragged rows and of 1; the third row's prompt + limit passes the
    pool's 256-slot capacity (a cache of 512: another cache length)."""
    rng = _rng("greedy")
    prompts = _prompts(rng, [(3, 40), (41, 120), (200, 230), (5, 77)])
    limits = [rng.randint(9, 30), rng.randint(17, 40), 60, rng.randint(20, 45)]
    eager, compiled = _run_like_the_cli(target, prompts, limits, 3, Sampling(), logprobs=logprobs)
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]
    if logprobs is not None:
        _same_logprobs(eager, compiled)


@pytest.mark.parametrize("sampling", [
    Sampling(temperature=0.8, top_k=40, top_p=0.9, seed=RNG.randrange(10**6)),
    Sampling(temperature=0.7, repetition_penalty=1.3, min_new_tokens=3, seed=RNG.randrange(10**6)),
], ids=["sampled", "penalties"])
def test_seeded_sampling_is_eager_token_for_token(target, sampling):
    """Sampling without logprobs runs BlockGraphs (several samples per prompt: 6 rows), with penalties the
    forward alone is compiled and the processing runs per step, here keeping each token's logprob."""
    rng = _rng(f"sampling-{sampling}")
    prompts = _prompts(rng, [(3, 30), (31, 90), (91, 150), (2, 50)])
    limits = [rng.randint(10, 30) for _ in prompts]
    penalties = sampling.repetition_penalty != 1
    eager, compiled = _run_like_the_cli(target, prompts, limits, 3, sampling, logprobs=0 if penalties else None,
                                        samples=1 if penalties else 2)
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]
    assert [r.seed for r in compiled] == [r.seed for r in eager]
    if penalties:
        _same_logprobs(eager, compiled)


def test_speculative_decoding_compiled_gives_the_same_tokens(target):
    """A draft that is the target with a noisy LM head: it proposes right often (long accepted chains, cache
    keep and truncate after each) and hesitates (CaPE grows alternatives). Greedy, and sampled with a seed."""
    rng = _rng("speculative")
    draft = copy.deepcopy(target)
    with torch.no_grad():
        w = draft.lm_head_weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(rng.randrange(1000))) * w.std() * 0.8)
    (prompt,), limit = _prompts(rng, [(20, 60)]), rng.randint(30, 45)
    plain = generate(target, [prompt], max_new_tokens=limit)[0].tokens
    # a chain of 2 to 4 tokens (buckets 2, 4) and CaPE trees of up to 7 (buckets up to 8); seeded sampling
    sampled = Sampling(temperature=0.9, top_k=50, seed=rng.randrange(10**6))
    runs = [dict(k=3, stop_below=0.5), dict(k=3, cape=CapeTable.parse("0.5:1,1:0")),
            dict(k=3, sampling=sampled, seed=sampled.seed)]
    step = CompiledStep()
    for run in runs:  # the CLI's warm-up under --draft (generate/speculative.py warm_up)
        warm_up(step, target, draft, run["k"], run.get("cape"))
    watch = RecompileWatch()
    for run in runs:
        eager = speculative_generate(target, ModelDrafter(draft, 200), prompt, max_new_tokens=limit, **run)
        calls = step.calls
        spec = speculative_generate(target, ModelDrafter(draft, 200, compile=step), prompt, max_new_tokens=limit,
                                    compile=step, **run)
        assert spec.tokens == eager.tokens, run
        assert "sampling" in run or spec.tokens == plain, run
        assert spec.accepted == eager.accepted and spec.proposed == eager.proposed, run
        assert step.calls - calls >= spec.passes, f"a verification ran eagerly: {run}"
    assert watch.take() == [], "the speculative warm-up left a graph to compile"
