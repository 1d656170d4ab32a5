"""Generation with the KV cache (models/kv_cache.py, generate/): greedy continuations token-identical to
transformers' greedy `generate` on random tiny checkpoints of every family, dense and MoE (fp32);
cached decoding equal to the full forward at every step; chunked prefill equal to one-shot; batched
prompts of different lengths equal to each alone; seeded sampling reproducible; bad input refused
before the weights are read; prefill memory flat in the prompt beside the cache (no [S, S])."""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402
import test_hf_moe  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.bench.generate import prefill_memory  # noqa: E402
from longctx.cli import build_parser  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402
from longctx.generate.cli import prepare  # noqa: E402
from longctx.generate.engine import generate  # noqa: E402
from longctx.generate.local import prefill  # noqa: E402
from longctx.generate.sampling import Sampling, filter_logits  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402
from longctx.models.kv_cache import KVCache  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402
from longctx.models.moe import moe_layers  # noqa: E402

NEW = 64
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen2_moe-mlp_only", "qwen3_moe", "olmoe")


def _prompt(length, vocab=300, seed=1):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _transformers_greedy(model, prompt, new=NEW):
    model.generation_config.eos_token_id = None  # exactly `new` tokens, as ours without eos_ids
    with torch.no_grad():
        ids = torch.tensor([prompt])  # (the mask given: with pad_token_id 0 alone, a prompt's 0s would read as padding)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", DENSE + MOE)
def test_greedy_matches_transformers(tmp_path, family):
    if family in DENSE:
        d, ref = test_hf.random_hf_dir(tmp_path, test_hf.hf_config(family))
    else:
        d, ref = test_hf_moe.random_hf_dir(tmp_path, test_hf_moe.hf_config(family))
    ours = load_hf(d)
    prompt = _prompt(40)
    theirs = _transformers_greedy(ref, prompt)
    got = generate(ours, [prompt], max_new_tokens=NEW, prefill_chunk=16)[0]
    assert got.finish_reason == "length" and len(got.tokens) == NEW
    assert got.tokens == theirs


def _debug_model(moe=False, seed=1):
    overrides = ["--model.preset=debug-moe"] if moe else ["--model.layers=2"]
    cfg = load_config(overrides=overrides).model
    model = build_model(cfg, seed=seed).eval()
    if moe:
        with torch.no_grad():  # routers of some conviction, as a trained model has
            for layer in moe_layers(model):
                layer.router.gate.weight.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cached_decoding_equals_full_forward_at_every_step(moe):
    """Rows of different lengths (ragged decode with a key mask), a chunked prefill, then 12 decode
    steps: each step's logits equal the full (uncached) forward of the sequence so far."""
    model = _debug_model(moe)
    vocab = model.cfg.vocab_size
    seqs = [_prompt(60, vocab, seed=s) for s in (2, 3)]
    lengths = [23, 31]
    cache = KVCache.for_model(model, 2, 64)
    worst = 0.0
    with torch.no_grad():
        for r, n in enumerate(lengths):
            got = prefill(model, cache.rows(r, r + 1), torch.tensor([seqs[r][:n]]), chunk=10)
            full = model(torch.tensor([seqs[r][:n]]))[:, -1]
            worst = max(worst, (got - full).abs().max().item())
        for step in range(12):
            nxt = torch.tensor([[seqs[r][lengths[r] + step]] for r in range(2)])
            got = model(nxt, cache=cache)[:, -1]
            for r in range(2):
                full = model(torch.tensor([seqs[r][:lengths[r] + step + 1]]))[0, -1]
                worst = max(worst, (got[r] - full).abs().max().item())
        assert cache.lengths.tolist() == [lengths[0] + 12, lengths[1] + 12]
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_chunked_prefill_equals_one_shot(moe):
    model = _debug_model(moe)
    tokens = torch.tensor([_prompt(50, model.cfg.vocab_size), _prompt(50, model.cfg.vocab_size, seed=4)])
    results = {}
    with torch.no_grad():
        for chunk in (0, 7, 16, 49):
            cache = KVCache.for_model(model, 2, 60)
            results[chunk] = (prefill(model, cache, tokens, chunk), cache)
    one_logits, one_cache = results[0]
    for chunk in (7, 16, 49):
        logits, cache = results[chunk]
        assert (logits - one_logits).abs().max().item() <= 1e-5
        assert (cache.k - one_cache.k).abs().max().item() <= 1e-5
        assert (cache.v - one_cache.v).abs().max().item() <= 1e-5
        assert cache.lengths.tolist() == [50, 50]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_batched_prompts_equal_each_alone(moe):
    """Three prompts of different lengths decoded together (two of one length share a prefill):
    each row's greedy tokens are those of the prompt alone."""
    model = _debug_model(moe)
    vocab = model.cfg.vocab_size
    prompts = [_prompt(17, vocab, 5), _prompt(33, vocab, 6), _prompt(17, vocab, 7)]
    together = generate(model, prompts, max_new_tokens=[20, 12, 16], prefill_chunk=8)
    for p, limit, r in zip(prompts, [20, 12, 16], together):
        alone = generate(model, [p], max_new_tokens=limit)[0]
        assert r.tokens == alone.tokens and len(r.tokens) == limit and r.prompt_tokens == len(p)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_flat_prefill_of_different_lengths_equals_each_alone(moe):
    """Short prompts of different lengths share one varlen prefill call (positions restart, attention
    masked per prompt): their cache rows and last logits equal each prompt's own prefill, and the
    generated tokens equal each prompt alone."""
    from longctx.generate.local import prefill_flat
    from longctx.generate.loop import prefill_calls

    model = _debug_model(moe)
    vocab = model.cfg.vocab_size
    prompts = [_prompt(n, vocab, 10 + n) for n in (5, 9, 17, 17, 33)]
    assert prefill_calls([5, 9, 17, 17, 33], 64, True) == [(True, 0, 4), (False, 4, 5)]
    assert prefill_calls([5, 9, 17, 17, 33], 64, False) == [(False, 0, 1), (False, 1, 2), (False, 2, 4), (False, 4, 5)]
    assert prefill_calls([40, 40, 70], 64, True) == [(False, 0, 2), (False, 2, 3)]
    with torch.inference_mode():
        flat = KVCache.for_model(model, 4, 40)
        logits = prefill_flat(model, flat, prompts[:4])
        for r, p in enumerate(prompts[:4]):
            own = KVCache.for_model(model, 1, 40)
            alone = prefill(model, own, torch.tensor([p]), 4096)
            assert torch.allclose(logits[r], alone[0], atol=1e-5, rtol=0)
            n = len(p)
            assert flat.lengths[r] == n
            assert torch.allclose(flat.k[:, r, :, :n], own.k[:, 0, :, :n], atol=1e-5, rtol=0)
            assert torch.allclose(flat.v[:, r, :, :n], own.v[:, 0, :, :n], atol=1e-5, rtol=0)
    together = generate(model, prompts, max_new_tokens=12, prefill_chunk=64)
    for p, r in zip(prompts, together):
        assert r.tokens == generate(model, [p], max_new_tokens=12)[0].tokens


def test_eos_and_stop_end_a_row():
    model = _debug_model()
    prompt = _prompt(20, model.cfg.vocab_size)
    free = generate(model, [prompt], max_new_tokens=10)[0].tokens
    eos = generate(model, [prompt], max_new_tokens=10, eos_ids=[free[3]])[0]
    assert eos.finish_reason == "eos" and eos.tokens == free[:free.index(free[3])]
    stop = generate(model, [prompt], max_new_tokens=10, stop=lambda row, toks: len(toks) == 4)[0]
    assert stop.finish_reason == "stop" and stop.tokens == free[:4]


def test_seeded_sampling_is_reproducible():
    model = _debug_model()
    prompts = [_prompt(12, model.cfg.vocab_size), _prompt(19, model.cfg.vocab_size, 9)]
    s = Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=7)
    a = generate(model, prompts, max_new_tokens=24, sampling=s)
    b = generate(model, prompts, max_new_tokens=24, sampling=s)
    c = generate(model, prompts, max_new_tokens=24, sampling=Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=8))
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]
    greedy = [r.tokens for r in generate(model, prompts, max_new_tokens=24)]
    assert [r.tokens for r in generate(model, prompts, max_new_tokens=24,
                                       sampling=Sampling(temperature=0.7, top_k=1, seed=3))] == greedy


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert keep(filter_logits(logits, top_p=0.8)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.81)) == [True, True, True, False]
    assert keep(filter_logits(logits, top_p=1.0)) == [True] * 4


def test_cache_refuses_what_does_not_fit():
    model = _debug_model()
    cache = KVCache.for_model(model, 1, 8)
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="at most 8 tokens"):
            model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        assert cache.lengths.tolist() == [6] and cache.step is None
        with pytest.raises(ValueError, match="no doc_ids"):
            model(torch.zeros(1, 1, dtype=torch.long), doc_ids=torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_prefill_memory_is_flat_beside_a_linear_cache():
    """2K, 4K, 8K-token prompts in chunks of 1K: the cache grows linearly, the prefill's own tensors
    peak at the same bytes whatever the prompt (one chunk's worth), far below one [S, S] score matrix."""
    cfg = load_config(overrides=["--model.layers=2", "--model.dim=64", "--model.heads=4", "--model.kv_heads=2",
                                 "--model.ffn_dim=160"]).model
    model = build_model(cfg, seed=1).eval()
    rows = [prefill_memory(model, n, chunk=1024) for n in (2048, 4096, 8192)]
    assert [r["cache_bytes"] for r in rows] == [rows[0]["cache_bytes"] * k for k in (1, 2, 4)]
    peaks = [r["peak_transient_bytes"] for r in rows]
    assert max(peaks) <= 1.05 * min(peaks), peaks
    assert max(r["largest_tensor_bytes"] for r in rows) <= 1024 * max(cfg.vocab_size, cfg.ffn_dim, cfg.dim) * 4
    assert max(peaks) < 8192 * 8192 * 4 / 16


# ------------------------------------------------------------------------------------------------
# bad input: one clear error each, before any weight is read (the checkpoint below has none)


@pytest.fixture
def weightless_hf(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    bpe_tokenizer(d / "tokenizer.json")
    return d


def _prepare(*argv):
    args, rest = build_parser("generate").parse_known_args(["generate", *argv])
    return prepare(args, rest)


def test_good_input_is_prepared_without_weights(weightless_hf):
    request = _prepare("--checkpoint", f"hf:{weightless_hf}", "--prompt", "def f(x):", "--max-new-tokens", "300")
    assert request.prompts[0]["ids"] and request.eos_ids == [0]  # the tokenizer's </s>
    assert request.limits == [256 - len(request.prompts[0]["ids"])] and "leave room for" in request.notes[0]


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "the prompt (--prompt) is empty"),
    (["--prompt", "x " * 400], "past the 256 positions the model reaches (trained on 256: its config.json's "
                               "max_position_embeddings). Raising --model.max_seq_len does not teach"),
    (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ([], "one of them"),
])
def test_bad_input_is_one_clear_error(weightless_hf, argv, message):
    with pytest.raises(ConfigError) as e:
        _prepare("--checkpoint", f"hf:{weightless_hf}", *argv)
    assert message in str(e.value)


def test_checkpoint_without_tokenizer_says_use_tokenizer(weightless_hf):
    (weightless_hf / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="Pass --tokenizer PATH/tokenizer.json"):
        _prepare("--checkpoint", f"hf:{weightless_hf}", "--prompt", "x")
    assert _prepare("--checkpoint", f"hf:{weightless_hf}", "--prompt", "x", "--tokenizer", "byte").prompts[0]["ids"] \
        == [ord("x")]


def test_bad_prompts_file(weightless_hf, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match='line 3 has no "prompt" string'):
        _prepare("--checkpoint", f"hf:{weightless_hf}", "--prompts", str(f))
    f.write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    with pytest.raises(ConfigError, match=r"prompt 2 \(--prompts line 2\) is empty"):
        _prepare("--checkpoint", f"hf:{weightless_hf}", "--prompts", str(f))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_few_new_tokens_in_one_masked_call_equal_the_two_call_merge(tree):
    """CPU, a speculative chain or tree to verify: one kernel call with a mask over the held slots
    and the new ones (models/kv_cache.py _small_chunk) against the prefix call + new-token call merged
    by the log-sum-exp (_chunk, masked_attention), grouped queries (8 heads over 2 kv heads)."""
    from longctx.models import cached_attention as kv
    from longctx.ops.attention import merge_partials

    g = torch.Generator().manual_seed(0)
    start, n, heads, d = 40, 6, 8, 16
    q = torch.randn(1, n, heads, d, generator=g)
    k, v = (torch.randn(1, 2, start + n + 3, d, generator=g) for _ in range(2))
    among = torch.ones(n, n, dtype=torch.bool).tril()
    if tree:  # node 3 hangs off node 1 (not node 2); node 5 off node 3
        among[3, 2] = among[4, 2] = among[5, 2] = among[5, 4] = False
    step = kv.CacheStep(np.array([start]), n, torch.arange(start, start + n)[None], among if tree else None)
    out, lse = kv._small_chunk(q, k, v, step, d ** -0.5)
    if tree:
        new_out, new_lse = kv.masked_attention(q, k[:, :, start:start + n], v[:, :, start:start + n], among)
        ref_out, ref_lse = merge_partials(*kv._full(q, k[:, :, :start], v[:, :, :start], d ** -0.5), new_out, new_lse)
    else:
        ref_out, ref_lse = kv._chunk(q, k, v, start, d ** -0.5)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)


def test_echo_puts_the_prompt_before_the_text(tmp_path):
    """--echo: a line's text is prompt + continuation (a draft's training text from the target's own
    continuations, read back as data.corpus); without it, the continuation alone."""
    from types import SimpleNamespace

    from longctx.data.tokenizer import load_tokenizer
    from longctx.generate.output import Output

    tok = load_tokenizer("byte")
    result = SimpleNamespace(tokens=list(map(int, tok.encode(" = 1"))), prompt_tokens=1, finish_reason="length",
                             prefill_tokens_per_s=1.0, decode_tokens_per_s=1.0)
    for echo, want in ((True, "x = 1"), (False, " = 1")):
        out = Output(tok, [], str(tmp_path / f"{echo}.jsonl"), 2, 4, True, echo=echo)
        out.write({"text": "x"}, result, speculative=False)
        out.close()
        assert json.loads((tmp_path / f"{echo}.jsonl").read_text())["text"] == want
