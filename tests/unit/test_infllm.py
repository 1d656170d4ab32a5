"""InfLLM context memory (models/context_memory.py, generate/context_memory.py): plain greedy until memory
exists; with every unit retrieved, equal to an independent per-query reference (its own RoPE, the
clipped distances written out); top-k picks the unit that matches the query; the attention of a long
prompt reads a bounded number of keys; the flags' and prompts' errors; the length guard lets InfLLM
prompts through (every distance stays within init + window + block)."""

import json
import math

import pytest
import torch

from longctx.config import ModelConfig
from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.engine import generate
from longctx.models import context_memory as cm
from longctx.models.context_memory import InfLLMMemory, InfLLMShape
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model

CFG = ModelConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128, vocab_size=97, init_std=0.2)


@pytest.fixture(scope="module")
def model():
    # one thread: this tiny model's many small calls wait on each other's thread barriers on a shared
    # 2-core machine (55 s for the 4K prompt with 2 threads under load, 1.5 s with one)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_model(CFG, seed=5).eval()
    torch.set_num_threads(threads)


def _prompt(n, seed=1):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_plain_until_memory_exists(model):
    shape = InfLLMShape(block=8, repr=2, topk=2, window=32, init=8)
    prompt = _prompt(36)  # 36 + 10 = 46 tokens < init + window + block = 48: no unit ever forms
    plain = generate(model, [prompt], max_new_tokens=10, prefill_chunk=16, logprobs=0)[0]
    backend = InfLLMGeneration(shape)
    ours = generate(model, [prompt], max_new_tokens=10, prefill_chunk=16, logprobs=0, backend=backend)[0]
    assert ours.tokens == plain.tokens and ours.logprobs == plain.logprobs
    assert backend.memory.built.max() == 0


def _turn(x, pos, inv_freq):
    """The reference's own RoPE: x [..., d] (rotate-half pairs (j, j + d/2)) turned by pos x inv_freq,
    as complex numbers."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * torch.polar(torch.ones_like(inv_freq.double()), pos * inv_freq.double())
    return torch.cat([z.real, z.imag], dim=-1)


def _reference_core(shape, ends, inv_freq):
    """Attention of the whole sequence as InfLLM with every unit retrieved: query i of a call ending at
    ends[i] sees all j <= i; at the real distance while no unit exists or j is in the local span, else
    (initial tokens, units) at distance init + window + block - 1. q and k arrive unrotated."""
    far = shape.init + shape.window + shape.block - 1

    def core(q, k, v, doc_ids):
        n, h, kv = q.shape[1], q.shape[2], k.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float64)
        for i in range(n):
            e = ends[i]
            init = min(shape.init, e)
            units = max(0, (e - shape.window - init) // shape.block)
            lo = init + units * shape.block
            dist = [(i - j) if units == 0 or j >= lo else far for j in range(i + 1)]
            kpos = torch.tensor([i - d for d in dist], dtype=torch.float64)[:, None]
            qi = _turn(q[0, i], torch.tensor(float(i)), inv_freq)  # [h, d]
            kj = _turn(k[0, :i + 1], kpos[:, None], inv_freq)  # [i + 1, kv, d]
            for head in range(h):
                g = head // (h // kv)
                p = torch.softmax(kj[:, g] @ qi[head] / math.sqrt(q.shape[-1]), dim=0)
                out[0, i, head] = p @ v[0, :i + 1, g].double()
        return out.to(q.dtype)
    return core


def test_everything_retrieved_equals_reference(model):
    shape = InfLLMShape(block=4, repr=2, topk=64, window=16, init=4)
    prompt, new = _prompt(80, seed=2), 12
    backend = InfLLMGeneration(shape)
    ours = generate(model, [prompt], max_new_tokens=new, prefill_chunk=8, logprobs=0, backend=backend)[0]
    assert backend.memory.built.max() > 0  # units formed (and all were retrieved: topk >= units)
    check_against_reference(model, prompt, ours, backend.chunk(8),
                            lambda index, ends, inv_freq: _reference_core(shape, ends, inv_freq))


def check_against_reference(model, prompt, ours, chunk: int, core_of_layer) -> None:
    """`ours` (a generation of `prompt` prefilled in chunks of `chunk`) equals the model run teacher-forced on
    prompt + its tokens with each layer's attention core replaced by core_of_layer(layer index, ends,
    inv_freq): greedy tokens, log-probabilities within 1e-4. ends[i]: the end of the call query i belonged
    to; the model's RoPE is off meanwhile (the reference turns q and k itself by inv_freq)."""
    seq = prompt + ours.tokens[:-1]
    ends = [min(len(prompt), (i // chunk + 1) * chunk) if i < len(prompt) else i + 1 for i in range(len(seq))]
    inv_freq = model.inv_freq.clone()
    cores = [b.attention.core for b in model.layers]
    try:
        model.inv_freq.zero_()
        for index, b in enumerate(model.layers):
            b.attention.core = core_of_layer(index, ends, inv_freq)
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, len(prompt) - 1:].float()
    finally:
        model.inv_freq.copy_(inv_freq)
        for b, c in zip(model.layers, cores):
            b.attention.core = c
    assert logits.argmax(-1).tolist() == ours.tokens
    ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ours.tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(ours.logprobs), ref_lp, atol=1e-4, rtol=0)


def test_topk_picks_the_unit_that_matches_the_query(model):
    shape = InfLLMShape(block=8, repr=2, topk=1, window=16, init=4)
    held, planted = 100, 5  # units: (101 - 16 - 4) // 8 = 10
    cache = KVCache.for_model(model, 1, 128)
    memory = InfLLMMemory(shape, model, 1, 128)
    gen = torch.Generator().manual_seed(0)
    kv, d = CFG.kv_heads, CFG.resolved_head_dim
    direction = torch.randn(kv, d, generator=gen)
    cache.k[0, 0] = 0.1 * torch.randn(kv, 128, d, generator=gen)
    slots = torch.arange(shape.init + planted * 8, shape.init + planted * 8 + 8)
    # the planted unit's keys point along the query, turned at their slots as the model caches them
    cache.k[0, 0, :, slots] = cm.rotate(direction.expand(1, 8, kv, d), slots[None], model.inv_freq)[0].transpose(0, 1)
    cache.lengths[:] = held
    chosen = []
    real_slots = memory._slots
    memory._slots = lambda c, b, init: (chosen.append(c.tolist()), real_slots(c, b, init))[1]
    step = cache.begin(1)
    q = cm.rotate(direction.repeat_interleave(2, 0)[None, None], torch.tensor([[held]]), model.inv_freq)
    memory.core(q, torch.zeros(1, 1, kv, d), torch.zeros(1, 1, kv, d), cache.layer(0), step)
    cache.end()
    assert chosen == [[[planted]]]


def test_a_long_prompt_reads_a_bounded_number_of_keys(model, monkeypatch):
    shape = InfLLMShape(block=32, repr=4, topk=4, window=256, init=16)
    local, gathered = [], []
    real_cached, real_forward = cm.cached_attention, cm.attention_forward

    def cached(q, k, v, step, **kw):
        if q.shape[1] == 1:
            local.append(int(step.start[0]) + step.new)  # the keys this call reads: the slots it holds
        return real_cached(q, k, v, step, **kw)

    def forward(q, k, v, **kw):
        if q.shape[1] == 1 * CFG.heads // CFG.kv_heads:  # a decode step's grouped queries
            gathered.append(k.shape[1])
        return real_forward(q, k, v, **kw)

    monkeypatch.setattr(cm, "cached_attention", cached)
    monkeypatch.setattr(cm, "attention_forward", forward)
    backend = InfLLMGeneration(shape)
    generate(model, [_prompt(4096, seed=3)], max_new_tokens=4, prefill_chunk=4096, backend=backend)
    steps = 3 * CFG.layers  # the first token comes from the prefill; 3 decode calls per layer
    assert len(local) == len(gathered) == steps
    assert set(gathered) == {shape.init + shape.topk * shape.block}  # 144 keys, whatever the prompt
    assert max(local) < shape.window + shape.block and min(local) >= shape.window
    assert max(a + b for a, b in zip(local, gathered)) <= shape.max_keys < 4096 // 8


# ------------------------------------------------------------------------------------------------
# the command's checks (a weightless Hugging Face directory trained on 64 positions: nothing is loaded)

@pytest.fixture
def hf64(tmp_path):
    transformers = pytest.importorskip("transformers")  # noqa: F841 (test_hf's config needs it)
    import test_hf
    from test_tokenizer_follows_model import bpe_tokenizer

    (tmp_path / "config.json").write_text(json.dumps(test_hf.hf_config("llama", max_position_embeddings=64)))
    bpe_tokenizer(tmp_path / "tokenizer.json")
    return tmp_path


def _prepare(d, *argv):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", *argv])
    return prepare(args, rest)


PROMPT = "x " * 100  # 101 tokens: past the 64 positions
# (shared: the paper's placement, whose reach init + window + block these checks are written in; ordered's:
# tests/unit/test_infllm_ordered_positions.py)
SMALL = ("--context-memory", "infllm", "--infllm-window", "16", "--infllm-block", "8", "--infllm-init", "8",
         "--infllm-positions", "shared")


def test_infllm_prompts_pass_the_length_guard(hf64):
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError, match="past the 64 positions"):
        _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "100")
    request = _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "100", *SMALL)
    assert request.limits == [100] and not request.notes and request.memory.far == 31


@pytest.mark.parametrize("flags, said", [
    (("--infllm-window", "64"), "= 80 positions, past the 64 the model reaches"),  # 8 + 64 + 8 > 64
    (("--infllm-block", "6"), "does not divide --infllm-window 16"),
    (("--infllm-repr", "9"), "more than the 8 tokens of a unit"),
    (("--infllm-topk", "0"), "--infllm-topk must be >= 1"),
    (("--nproc", "2", "--parallel.head=2"), "over ctx ranks only"),
    (("--compile",), "drop --compile"),
    (("--draft", "hf:/nowhere"), "drop --draft"),
    (("--model.rope_ms_poe=true", "--model.rope_ms_poe_skip_layers=0"), "drop --model.rope_ms_poe"),
])
def test_bad_input_is_one_error_before_work(hf64, flags, said):
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError, match=said):
        _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "4", *SMALL, *flags)


def test_several_processes_shard_the_memory_over_ctx_ranks(hf64, tmp_path):
    # --nproc N with no layout: ctx N (generate/sharded_infllm.py; its answers: tests/distributed/
    # test_sharded_infllm.py); generate and eval alike
    request = _prepare(hf64, "--prompt", PROMPT, "--max-new-tokens", "4", *SMALL, "--nproc", "2")
    assert (request.cfg.parallel.head, request.cfg.parallel.ctx) == (1, 2) and request.memory.window == 16
    evaluated = _prepare_eval(hf64, tmp_path, "--lengths", "96", "--mode", "generate", *SMALL, nproc=2)
    assert (evaluated.cfg.parallel.head, evaluated.cfg.parallel.ctx) == (1, 2)


def test_a_window_larger_than_the_prompt_is_an_error(hf64):
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError, match="--infllm-window 16 is larger than the prompt"):
        _prepare(hf64, "--prompt", "x " * 5, *SMALL)


# ------------------------------------------------------------------------------------------------
# longctx eval --mode generate --context-memory infllm: the same flags and checks, plus eval's own

def _prepare_eval(d, tmp_path, *argv, nproc=1):
    from longctx.cli import build_parser
    from longctx.eval.request import prepare

    filler = tmp_path / "filler.txt"
    filler.write_text("The grass is green and the sky is blue. " * 300)
    args, rest = build_parser("eval").parse_known_args(["eval", "--checkpoint", f"hf:{d}", "--task", "passkey",
                                                        "--data", str(filler), "--samples", "1", *argv])
    return prepare(args, rest, nproc)


def test_eval_takes_the_memory_in_generate_mode(hf64, tmp_path):
    from longctx.errors import ConfigError

    plain = _prepare_eval(hf64, tmp_path, "--lengths", "96", "--mode", "generate")
    assert plain.memory is None and any("past the 64 positions" in n for n in plain.notes)
    request = _prepare_eval(hf64, tmp_path, "--lengths", "96", "--mode", "generate", *SMALL)
    assert request.memory.window == 16 and request.memory.far == 31 and not request.notes
    for argv, nproc, said in (((), 1, "add --mode generate"),
                              (("--mode", "generate", "--batch", "2"), 1, "one sequence at a time"),
                              (("--mode", "generate", "--infllm-window", "64"), 1, "past the 64 the model reaches"),
                              (("--mode", "generate", "--parallel.head=2"), 2, "over ctx ranks only")):
        with pytest.raises(ConfigError, match=said):
            _prepare_eval(hf64, tmp_path, "--lengths", "96", *SMALL, *argv, nproc=nproc)
    with pytest.raises(ConfigError, match="--infllm-window 32 is larger than the 24-token sequences.*Use "
                                          "--infllm-window 24,"):
        _prepare_eval(hf64, tmp_path, "--lengths", "24,96", "--mode", "generate", "--context-memory", "infllm",
                      "--infllm-window", "32", "--infllm-block", "8", "--infllm-init", "8",
                      "--infllm-positions", "shared")
    with pytest.raises(ConfigError, match="than the 6-token sequences.*an --infllm-block and --infllm-window of at "
                                          "most 6"):  # (no whole unit of 8 fits: a window of 8 would not either)
        _prepare_eval(hf64, tmp_path, "--lengths", "6,96", "--mode", "generate", "--context-memory", "infllm",
                      "--infllm-window", "32", "--infllm-block", "8", "--infllm-init", "8",
                      "--infllm-positions", "shared")
