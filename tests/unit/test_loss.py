"""Chunked LM head + cross-entropy (ops/loss.py): same values and gradients as the plain path, and
never a [tokens, vocab] tensor."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from longctx.ops.loss import lm_head_loss
from probes import LargestOutput


def _data(n, d, v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=dtype) * 0.1).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return h, w, labels


def _reference(h, w, labels, reduction):
    return F.cross_entropy(F.linear(h, w).double(), labels, ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_matches_plain_values_and_gradients(reduction, chunk):
    h, w, labels = _data(300, 16, 97)
    ref = _reference(h, w, labels, reduction)
    ref_grads = torch.autograd.grad(ref, (h, w))
    out = lm_head_loss(h, w, labels, chunk=chunk, reduction=reduction)
    grads = torch.autograd.grad(out, (h, w))
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-5, atol=1e-6)


def test_chunked_gradcheck_fp64():
    h, w, labels = _data(40, 6, 11, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: lm_head_loss(a, b, labels, chunk=9), (h, w))


@pytest.mark.parametrize("chunk", [7, 64])
def test_final_norm_inside_the_chunked_loss_matches_norm_then_loss(chunk):
    # the norm is recomputed per chunk in backward: its weight's gradient sums over chunks
    h, w, labels = _data(300, 16, 97)
    nw = (1 + 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(3))).requires_grad_()
    xn = nw * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5))
    ref = _reference(xn, w, labels, "mean")
    ref_grads = torch.autograd.grad(ref, (h, w, nw))
    out = lm_head_loss(h, w, labels, chunk=chunk, norm=(nw, 1e-5))
    grads = torch.autograd.grad(out, (h, w, nw))
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-5, atol=1e-6)


def test_final_norm_gradcheck_fp64():
    h, w, labels = _data(40, 6, 11, dtype=torch.float64)
    nw = torch.rand(6, dtype=torch.float64).add_(0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: lm_head_loss(a, b, labels, chunk=9, norm=(c, 1e-6)), (h, w, nw))


def test_all_ignored_gives_zero_not_nan():
    h, w, labels = _data(50, 8, 13)
    labels[:] = -100
    out = lm_head_loss(h, w, labels, chunk=16)
    out.backward()
    assert out.item() == 0.0 and torch.all(h.grad == 0)


def test_no_op_ever_produces_tokens_x_vocab():
    n, v, chunk = 4096, 8192, 512
    h, w, labels = _data(n, 16, v)
    with LargestOutput() as probe:
        lm_head_loss(h, w, labels, chunk=chunk).backward()
    assert probe.largest <= chunk * v, probe.largest
    with LargestOutput() as plain:
        lm_head_loss(h.detach().requires_grad_(), w, labels, chunk=0).backward()
    assert plain.largest >= n * v  # the probe does see a [tokens, vocab] tensor when there is one


_RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from longctx.ops.loss import lm_head_loss
    n, v, d, chunk = (int(a) for a in sys.argv[1:5])
    torch.manual_seed(0)
    h = torch.randn(n, d, requires_grad=True)
    w = (torch.randn(v, d) * 0.02).requires_grad_()
    labels = torch.randint(0, v, (n,))

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    # growth from the RSS now, with the high-water mark reset (an earlier peak, e.g. from imports,
    # would otherwise hide part of the growth); where the reset is refused, ru_maxrss stands in
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base, peak_of = status("VmRSS"), lambda: status("VmHWM")
    except OSError:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak_of = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss = lm_head_loss(h, w, labels, chunk=chunk)
    loss.backward()
    print(json.dumps({"growth": peak_of() - base, "loss": loss.item()}))
""")


def _rss_growth(n, v, d, chunk):
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(n), str(v), str(d), str(chunk)],
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout)["growth"]


@pytest.mark.slow
def test_chunked_loss_at_128k_vocab_4k_tokens_stays_far_below_one_logits_tensor():
    # 4K tokens in chunks of 256 (16 chunks, as 16K in chunks of 1,024 and 8K in chunks of 512: the same ratio)
    # measure the same thing at a quarter of 16K's compute: the chunked growth was 13-14% of one logits tensor
    # at each size (0.28 of 2 GiB, 0.53 of 4 GiB, 1.03 of 8 GiB; 2026-12-03), a plain (unchunked) path >= 100%
    v, d = 131072, 32
    n_chunked, chunk = 4096, 256
    full_logits = n_chunked * v * 4  # one fp32 [tokens, vocab] tensor: 2 GiB
    grown = _rss_growth(n_chunked, v, d, chunk)
    # the plain path at 1/8 of the tokens already grows by more than one [tokens, vocab] tensor...
    n_plain = 512
    plain = _rss_growth(n_plain, v, d, 0)
    assert plain >= n_plain * v * 4
    # ...while the chunked one at 4K tokens stays within a few chunks' worth
    assert grown < full_logits / 4, (grown, plain)
    print(f"peak RSS growth: chunked 4K x 128K = {grown / 2**30:.2f} GiB; plain 512 x 128K = {plain / 2**30:.2f} GiB; "
          f"one 4K x 128K fp32 logits tensor = {full_logits / 2**30:.0f} GiB")
