import pytest
import torch

from longctx.config import load_config
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.llama import apply_rope, build_model, count_params, rope_cos_sin


def small(**kw):
    return load_config(overrides=[f"--model.{k}={v}" for k, v in kw.items()]).model


def test_meta_build_allocates_nothing_and_has_published_sizes():
    sizes = {}
    for preset in ("llama3-1b", "llama3-3b", "llama3-8b", "llama3-70b"):
        m = build_model(small(preset=preset), device="meta")
        assert all(p.is_meta for p in m.parameters())
        sizes[preset] = count_params(m) / 1e9
    assert sizes["llama3-1b"] == pytest.approx(1.236, abs=0.01)
    assert sizes["llama3-3b"] == pytest.approx(3.213, abs=0.01)
    assert sizes["llama3-8b"] == pytest.approx(8.030, abs=0.01)
    assert sizes["llama3-70b"] == pytest.approx(70.55, abs=0.05)


def test_logits_without_labels_and_loss_with_labels():
    cfg = small()
    m = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = m(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    labels = tokens.roll(-1, 1)
    labels[:, -3:] = -100
    mean = m(tokens, labels=labels)
    total = m(tokens, labels=labels, loss_reduction="sum")
    ref = torch.nn.functional.cross_entropy(logits[:, :-3].reshape(-1, cfg.vocab_size), labels[:, :-3].reshape(-1))
    torch.testing.assert_close(mean, ref)
    torch.testing.assert_close(total, ref * 26)


def test_seeded_init_is_deterministic_and_seed_dependent():
    cfg = small()
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.layers[0].attention.wq.weight, c.layers[0].attention.wq.weight)


def test_tied_embeddings_share_one_tensor():
    m = build_model(small(tie_embeddings="true"))
    assert m.output is None and m.lm_head_weight is m.tok_embeddings.weight
    assert "output.weight" not in m.state_dict()


def test_positions_default_to_arange_and_packed_positions_isolate_documents():
    cfg = small()
    m = build_model(cfg)
    a = torch.randint(0, cfg.vocab_size, (1, 10))
    b = torch.randint(0, cfg.vocab_size, (1, 6))
    torch.testing.assert_close(m(a), m(a, positions=torch.arange(10)[None]))
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(10), torch.arange(6)])[None]
    doc = torch.cat([torch.zeros(10), torch.ones(6)]).long()[None]
    out = m(packed, positions=pos, doc_ids=doc)
    # each document in the pack gives exactly the logits it gives alone
    torch.testing.assert_close(out[:, :10], m(a), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 10:], m(b), atol=1e-5, rtol=1e-5)
    # without the document mask the second document sees the first: a different result
    assert not torch.allclose(m(packed, positions=pos)[:, 10:], m(b), atol=1e-3)


def test_rope_is_relative():
    """q.k after RoPE depends only on the position difference."""
    cfg = small()
    from longctx.models.llama import rope_inv_freq

    inv = rope_inv_freq(cfg)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def dot(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([[pq]]), inv)
        ck, sk = rope_cos_sin(torch.tensor([[pk]]), inv)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(dot(5, 2), dot(105, 102), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(dot(5, 2), dot(5, 3), atol=1e-4)


def test_full_recompute_keeps_names_and_gradients():
    cfg = small()
    a, b = build_model(cfg), build_model(cfg)
    apply_memory_policy(b.layers, "full")
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    labels = tokens.roll(-1, 1)
    a(tokens, labels=labels).backward()
    b(tokens, labels=labels).backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=0), n
