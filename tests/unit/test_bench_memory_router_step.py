"""`longctx bench memory` measures a training step of an MoE model as training runs it: the LM loss and the router
terms (balancing and z losses: step/loss.py training_loss), not the LM loss alone. Checked through the bench's
functions by the routers' gradients (debug-moe, moe.aux_loss 0.01, moe.z_loss 0.001): the activation measurement's
backward (measure_activations, as _measure_policy runs it) and step_loss (the timed step, the GPU peak's step and
the --max-seq probe's step) give the training loss's, and the LM loss alone gives others."""

import argparse

import pytest
import torch

from longctx.bench import memory

SEQ = 64


def _args():
    p = argparse.ArgumentParser()
    memory.add_arguments(p)
    return p.parse_args(["--preset", "debug-moe", "--layers", "2", "--max-seq-step", "64"])


@pytest.fixture(scope="module")
def setting():
    args = _args()
    model_cfg = memory._model_cfg(args)
    assert model_cfg.moe_aux_loss > 0 and model_cfg.moe_z_loss > 0
    inputs = memory._batch(model_cfg.vocab_size, SEQ, 2, 2, torch.device("cpu"))
    return args, model_cfg, inputs


def _model(setting):
    args, model_cfg, _ = setting
    return memory._build(model_cfg, "selective", 0.0, args, None, None, torch.device("cpu"))


def _router_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n and p.grad is not None}


def _expected(setting, router_terms: bool) -> dict:
    """The routers' gradients of the mean LM loss, plus the router terms' (training's, one micro-batch) or not."""
    model, inputs = _model(setting), setting[2]
    loss = model(*inputs[:3], labels=inputs[3])
    (loss + model.router_terms().loss if router_terms else loss).backward()
    return _router_grads(model)


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-9) for k in a)


def test_step_loss_backwards_the_router_terms(setting):
    model = _model(setting)
    memory.step_loss(model, setting[2]).backward()
    got = _router_grads(model)
    assert got and _close(got, _expected(setting, True))
    assert not _close(got, _expected(setting, False))


def test_the_measured_backward_has_the_router_terms(setting):
    args, model_cfg, inputs = setting
    model = _model(setting)
    entry = memory._measure_policy(model, model_cfg, "selective", 0.0, args, SEQ, (1, 1), inputs, torch.device("cpu"))
    assert entry["measured_total_device_bytes"] > 0
    got = _router_grads(model)
    assert got and _close(got, _expected(setting, True))


def test_timed_and_probed_steps_are_step_loss(setting, monkeypatch):
    args, _, inputs = setting
    calls = []
    real = memory.step_loss
    monkeypatch.setattr(memory, "step_loss", lambda *a, **k: calls.append(a[1:]) or real(*a, **k))
    memory._one_step(_model(setting), inputs, torch.device("cpu"))
    assert "peak_rss_bytes" in memory._probe_step(args, "selective", 0.0, SEQ)
    assert len(calls) == 2
