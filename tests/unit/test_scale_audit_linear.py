"""Scale audit: no model-level path builds a tensor that grows with S x S (DESIGN.md principle 9).

Each path runs at S and 2S tokens on a 1-layer, dim-64 model and the largest tensor any op outputs is
recorded (tests/probes.py LargestOutput): a doubling of S may at most double it (linear terms: the
residual stream, the MLP's ffn_dim per token, the KV cache), where one S x S tensor would quadruple it.
Paths: a training forward + backward under every recompute policy, with and without block / attention
chunks, packed documents and one document; evaluation's scoring forward (`loss_reduction="tokens"`);
generation's chunked prefill and cached decode steps. Kernels' internal buffers are not seen here
(the ops audits bound those: test_ops_long_audit.py)."""

import pytest
import torch

from longctx.config import load_config
from longctx.generate.local import prefill
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model
from longctx.parallel.parallelize import apply_memory
from probes import LargestOutput

SHAPE = ["--model.layers=1", "--model.dim=64", "--model.ffn_dim=192"]
S = 1024  # and 2S; an [S, S] tensor (1M elements) is then already the largest of all
CHUNK = 256
DOC_LEN = 128

POLICIES = {
    "none": [],
    "selective": ["--memory.recompute=selective"],
    "full": ["--memory.recompute=full"],
    "none+attention_chunk": [f"--memory.attention_chunk={CHUNK}"],
    "full+chunks": ["--memory.recompute=full", f"--memory.block_chunk={CHUNK}", f"--memory.attention_chunk={CHUNK}"],
    "selective+chunks": ["--memory.recompute=selective", f"--memory.block_chunk={CHUNK}",
                         f"--memory.attention_chunk={CHUNK}"],
    "selective+chunks+offload": ["--memory.recompute=selective", f"--memory.block_chunk={CHUNK}",
                                 f"--memory.attention_chunk={CHUNK}", "--memory.attention_offload=true"],
}


def _model(memory):
    cfg = load_config(overrides=SHAPE + [f"--memory.loss_chunk={CHUNK}"] + memory)
    model = build_model(cfg.model, seed=0)
    apply_memory(model, cfg.memory, "cpu")
    return cfg.model, model


def _batch(vocab, seq, packed):
    g = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, vocab, (1, seq), generator=g)
    labels = torch.randint(0, vocab, (1, seq), generator=g)
    if not packed:
        return tokens, torch.arange(seq)[None], None, labels
    return tokens, (torch.arange(seq) % DOC_LEN)[None], (torch.arange(seq) // DOC_LEN)[None], labels


def _growth(run) -> tuple[int, int]:
    sizes = []
    for seq in (S, 2 * S):
        with LargestOutput() as probe:
            run(seq)
        sizes.append(probe.largest)
    return sizes[0], sizes[1]


def _assert_linear(small, large):
    # linear: 2x (a constant, a weight, can make it less); one S x S tensor: 4x
    assert large <= 2.2 * small, f"largest op output {small:,} elements at {S} tokens, {large:,} at {2 * S}"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-document"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_training_step_grows_linearly(policy, packed):
    cfg, model = _model(POLICIES[policy])

    def step(seq):
        tokens, positions, doc_ids, labels = _batch(cfg.vocab_size, seq, packed)
        model.zero_grad(set_to_none=True)
        model(tokens, positions, doc_ids, labels=labels).backward()

    _assert_linear(*_growth(step))


@pytest.mark.parametrize("policy", ["none", "full+chunks"])
def test_evaluation_scoring_grows_linearly(policy):
    cfg, model = _model(POLICIES[policy])
    model.eval()

    @torch.no_grad()
    def score(seq):
        tokens, positions, _, labels = _batch(cfg.vocab_size, seq, packed=False)
        model(tokens, positions, None, labels=labels, loss_reduction="tokens")

    _assert_linear(*_growth(score))


def test_generation_prefill_and_decode_grow_linearly():
    cfg, model = _model([])
    model.eval()

    @torch.no_grad()
    def generate(seq):
        tokens = _batch(cfg.vocab_size, seq, packed=False)[0]
        cache = KVCache.for_model(model, 1, seq + 4)
        token = prefill(model, cache, tokens, CHUNK).argmax(-1)[:, None]
        for _ in range(3):
            token = model.logits(model.hidden_states(token, cache=cache)[:, -1]).argmax(-1)[:, None]

    _assert_linear(*_growth(generate))
