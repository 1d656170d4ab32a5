"""The Mixture of Experts layer and its kernels against hand-written references on small cases
(models/moe.py, ops/grouped.py): the MoE layer against a per-token loop (shared experts, capacity),
grouped_mm against per-group matmuls (and the CUDA kernel's glue), the dispatch's backward without a
scatter-add (TokenRows, the same bits twice), and recomputation. The routers are in test_moe_routers.py
(whose helpers this imports), the balancing losses in test_moe_router_losses.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_moe_routers import DIM, T, grads, leaf, make_layer, ref_softmax

from longctx.config import load_config
from longctx.ops.grouped import grouped_mm

# ----------------------------------------------------------------------------------------------
# the MoE layer against a per-token loop


def swiglu(x, w1, w3, w2):
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


def ref_layer(x, params, k, norm, capacity_factor=0.0, shared=False, gate=False):
    """sum over the token's kept choices of weight x SwiGLU_e(x) (+ the shared experts, gated)."""
    chosen, weights = ref_softmax(x, params["router.gate.weight"], k, norm)
    e = params["router.gate.weight"].shape[0]
    kept = [[True] * k for _ in chosen]
    if capacity_factor:  # slot 0's choices first, then slot 1's, each in token order
        cap = math.ceil(capacity_factor * len(chosen) * k / e)
        load = [0] * e
        for j in range(k):
            for t, c in enumerate(chosen):
                kept[t][j] = load[c[j]] < cap
                load[c[j]] += 1
    rows = []
    for t, row in enumerate(x):
        y = torch.zeros(DIM)
        for j, ex in enumerate(chosen[t]):
            if kept[t][j]:
                y = y + weights[t, j] * swiglu(row, params["experts.w1"][ex], params["experts.w3"][ex],
                                               params["experts.w2"][ex])
        if shared:
            s = swiglu(row, params["shared.w1.weight"], params["shared.w3.weight"], params["shared.w2.weight"])
            if gate:
                s = torch.sigmoid(params["shared_gate.weight"] @ row) * s
            y = y + s
        rows.append(y)
    return torch.stack(rows), kept


@pytest.mark.parametrize("shared,gate,capacity,norm", [
    (False, False, 0.0, True), (True, False, 0.0, False), (True, True, 0.0, True),
    (False, False, 0.5, True), (True, True, 0.75, False)])
def test_layer_matches_a_per_token_loop(shared, gate, capacity, norm):
    moe = dict(top_k=2, norm_topk=norm, capacity_factor=capacity)
    if shared:
        moe.update(shared_experts=1, shared_gate=gate)
    layer = make_layer(**moe)
    x = torch.randn(T, DIM)
    x1, x2 = leaf(x), leaf(x)
    params = {n: leaf(p) for n, p in layer.named_parameters()}
    y = layer(x1.view(2, T // 2, DIM))  # [batch, seq, dim] in, the same shape out
    ref, kept = ref_layer(x2, params, 2, norm, capacity, shared, gate)
    assert y.shape == (2, T // 2, DIM)
    torch.testing.assert_close(y.view(T, DIM), ref, rtol=1e-5, atol=1e-5)
    if capacity:
        dropped = sum(not k for row in kept for k in row)
        assert 0 < dropped < 2 * T  # the case drops some choices, not all
        # and it pins the order: token-major dropping would keep other choices
        chosen = ref_softmax(x, layer.router.gate.weight.detach(), 2, norm)[0]
        cap, load, token_major = math.ceil(capacity * T * 2 / 8), [0] * 8, []
        for c in chosen:
            token_major.append([load[e] < cap for e in c])
            for e in c:
                load[e] += 1
        assert token_major != kept
    coef = torch.randn(T, DIM)
    names = [n for n, _ in layer.named_parameters()]
    g1 = grads((y.view(T, DIM) * coef).sum(), x1, *[dict(layer.named_parameters())[n] for n in names])
    g2 = grads((ref * coef).sum(), x2, *[params[n] for n in names])
    for name, a, b in zip(["x", *names], g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


# ----------------------------------------------------------------------------------------------
# grouped_mm


@pytest.mark.parametrize("counts", [[3, 0, 2, 0, 1], [0, 6, 0, 0, 0], [1, 1, 1, 1, 2], [0, 0, 0, 0, 6]])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_matches_per_group_matmuls(counts, transposed):
    n, d_in, d_out, g = sum(counts), 5, 3, len(counts)
    x = torch.randn(n, d_in)
    base = torch.randn(g, d_out, d_in) if transposed else torch.randn(g, d_in, d_out)
    b1, b2, x1, x2 = leaf(base), leaf(base), leaf(x), leaf(x)
    w1 = b1.transpose(1, 2) if transposed else b1  # as the experts pass their [E, out, in] weights
    w2 = b2.transpose(1, 2) if transposed else b2
    out = grouped_mm(x1, w1, torch.tensor(counts))
    parts, start = [], 0
    for i, c in enumerate(counts):
        parts.append(x2[start:start + c] @ w2[i])
        start += c
    ref = torch.cat(parts)
    torch.testing.assert_close(out, ref)
    coef = torch.randn(n, d_out)
    for a, b in zip(grads((out * coef).sum(), x1, b1), grads((ref * coef).sum(), x2, b2)):
        torch.testing.assert_close(a, b)
    # the weights of the empty groups get a zero gradient
    gw = grads((grouped_mm(leaf(x), w1, torch.tensor(counts)) * coef).sum(), b1)[0]
    for i, c in enumerate(counts):
        if not c:
            assert not gw[i].any()


def test_grouped_mm_with_no_rows_keeps_the_weight_in_the_graph():
    w = torch.randn(3, 4, 2, requires_grad=True)
    out = grouped_mm(torch.randn(0, 4), w, torch.tensor([0, 0, 0]))
    assert out.shape == (0, 2)
    (g,) = grads(out.sum(), w)
    assert g.shape == w.shape and not g.any()


def test_the_grouped_kernel_glue_meets_its_offsets_contract():
    """The CUDA path's glue (kernel_grouped_mm: END offsets, int32) against the loop, run through
    torch._grouped_mm on the CPU where the build allows it (fp32, 16-byte-aligned shapes), with an
    empty group, and with the experts' transposed [E, out, in] weights."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    from longctx.ops.grouped import kernel_grouped_mm

    counts = torch.tensor([24, 0, 8, 32])
    x = torch.randn(int(counts.sum()), 16)
    for w in (torch.randn(4, 16, 8), torch.randn(4, 8, 16).transpose(1, 2)):
        try:
            out = kernel_grouped_mm(x, w, counts)
        except RuntimeError as e:  # a build whose CPU kernel refuses this layout
            pytest.skip(f"torch._grouped_mm on CPU: {e}")
        torch.testing.assert_close(out, grouped_mm(x, w, counts))


def test_the_no_rows_case_still_reaches_the_input():
    """Under expert parallelism a rank may receive no rows; backward must still reach the all-to-all
    that produced them (or every other rank waits): the output is a function of x too."""
    x = torch.randn(0, 4, requires_grad=True)
    out = grouped_mm(x, torch.randn(3, 4, 2, requires_grad=True), torch.tensor([0, 0, 0]))
    (g,) = grads(out.sum(), x)
    assert g.shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_grouped_kernel_matches_the_loop(monkeypatch, autocast):
    """torch._grouped_mm on the GPU (bf16) against the loop over groups on the same bf16 operands:
    outputs and the gradients of x and of the experts' transposed [E, out, in] weights, with empty
    groups. Under autocast the weights are fp32 (one GPU, no FSDP) and the kernel must still run."""
    from longctx.ops import grouped

    calls = []
    kernel = grouped.kernel_grouped_mm
    monkeypatch.setattr(grouped, "kernel_grouped_mm", lambda *a: calls.append(1) or kernel(*a))
    counts = torch.tensor([96, 0, 40, 256, 0, 8], device="cuda")
    dtype = torch.float32 if autocast else torch.bfloat16
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=dtype)
    base = torch.randn(6, 128, 64, device="cuda", dtype=dtype) / 8  # [E, out, in], used transposed
    coef = torch.randn(x.shape[0], 128, device="cuda")

    def run(loop: bool):
        xl, bl = leaf(x), leaf(base)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if loop:
                with grouped.use_loop():
                    out = grouped_mm(xl, bl.transpose(1, 2), counts)
            else:
                out = grouped_mm(xl, bl.transpose(1, 2), counts)
        return out, grads((out.float() * coef).sum(), xl, bl)

    out, (gx, gw) = run(loop=False)
    assert calls, "the grouped kernel did not run"
    ref, (rx, rw) = run(loop=True)
    assert out.dtype == torch.bfloat16
    for got, want in ((out, ref), (gx, rx), (gw, rw)):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    assert not gw[1].any() and not gw[4].any()  # the empty groups' weights get a zero gradient


# ----------------------------------------------------------------------------------------------
# the dispatch's backward without a scatter-add (TokenRows)


def _dispatch_grads(tokens: int, k: int, dropped: int, device="cpu", reference=False, seed=0):
    """The gradient of a token-row gather over t x k slots sorted by a random expert choice, the
    last `dropped` sorted slots cut (a capacity): TokenRows', or index_select's autograd (reference)."""
    from longctx.models.moe import TokenRows

    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(tokens, 24, generator=gen).to(device).requires_grad_(True)
    choice = torch.randint(0, 8, (tokens * k,), generator=gen).to(device)
    order = torch.argsort(choice, stable=True)
    inverse = torch.argsort(order)
    order = order[: tokens * k - dropped]
    coef = torch.randn(order.numel(), 24, generator=gen).to(device)
    rows = flat.index_select(0, order // k) if reference else TokenRows.apply(flat, order, inverse, k)
    (g,) = grads((rows * coef).sum(), flat)
    return rows.detach(), g


@pytest.mark.parametrize("k,dropped", [(1, 0), (2, 0), (3, 0), (4, 0), (3, 17)])
def test_token_rows_gradient_is_index_selects_summed_in_slot_order(k, dropped):
    rows, g = _dispatch_grads(64, k, dropped)
    ref_rows, ref_g = _dispatch_grads(64, k, dropped, reference=True)
    assert torch.equal(rows, ref_rows)
    assert g.abs().sum() > 0
    torch.testing.assert_close(g, ref_g, rtol=1e-6, atol=1e-6)  # (only the summation order differs)
    if dropped:  # a token whose every slot was dropped gets a zero gradient, not garbage
        _, g_all = _dispatch_grads(64, k, 64 * k - 1)
        assert (g_all == 0).all(1).sum() >= 63
    assert torch.equal(_dispatch_grads(64, k, dropped)[1], g)  # bitwise, twice


def test_layer_gradients_are_the_same_bits_twice():
    """The whole layer (top-3, with and without a capacity): outputs and every gradient, bitwise."""
    def run(layer, x):
        xl = leaf(x)
        y = layer(xl)
        return [y.detach(), *grads((y * torch.linspace(-1, 1, DIM)).sum(), xl, *layer.parameters())]

    for capacity in (0.0, 0.5):
        layer, x = make_layer(top_k=3, capacity_factor=capacity), torch.randn(T, DIM)
        for a, b in zip(run(layer, x), run(layer, x)):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_dispatch_backward_is_the_same_bits_twice():
    """On CUDA: many tokens per expert at top-4, so index_add_'s atomics would collide; two runs of
    the dispatch's backward and of the layer's give the same bits, and equal index_select's to rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for dropped in (0, 1000):
        first, second = (_dispatch_grads(8192, 4, dropped, "cuda")[1] for _ in range(2))
        assert torch.equal(first, second)
        torch.testing.assert_close(first, _dispatch_grads(8192, 4, dropped, "cuda", reference=True)[1],
                                   rtol=1e-5, atol=1e-5)
    layer = make_layer(top_k=4).cuda()
    x = torch.randn(4096, DIM, device="cuda")

    def run():
        xl = leaf(x)
        y = layer(xl)
        return grads((y * y).sum(), xl, layer.router.gate.weight)

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# recomputation


def _loss_and_grads(model, tokens):
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]) + model.router_terms().loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy,chunk", [("full", 0), ("selective", 0), ("full", 24), ("selective", 24)])
def test_recomputation_does_not_change_routing(policy, chunk):
    from longctx.memory.apply_policy import apply_memory_policy
    from longctx.models.llama import build_model

    cfg = load_config(overrides={"model": {"preset": "debug-moe"}}).model
    tokens = torch.randint(0, cfg.vocab_size, (2, 65))
    plain = build_model(cfg, seed=3)
    loss0, g0 = _loss_and_grads(plain, tokens)
    recomputed = build_model(cfg, seed=3)
    apply_memory_policy(recomputed.layers, policy, block_chunk=chunk)
    loss1, g1 = _loss_and_grads(recomputed, tokens)
    # the same router statistics: nothing recorded twice by the recomputation, the same choices
    stats = []
    for model in (plain, recomputed):
        model(tokens[:, :-1], labels=tokens[:, 1:])
        stats.append(model.router_terms())
    assert torch.equal(stats[0].counts, stats[1].counts)
    assert g0.keys() == g1.keys()
    if chunk == 0:  # the same computation, recomputed: the same bits
        assert torch.equal(stats[0].stats, stats[1].stats)
        assert torch.equal(loss0, loss1)
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name
    else:  # the token-wise parts in chunks: the same routing, sums in another order
        torch.testing.assert_close(stats[0].stats, stats[1].stats)
        torch.testing.assert_close(loss0, loss1, rtol=1e-6, atol=1e-6)
        for name in g0:
            torch.testing.assert_close(g0[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)
