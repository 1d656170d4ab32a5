"""The planner's validation step (planner/validate_ranks.py train_step) backwards what a training step backwards
(step/loss.py training_loss; train/step_run.py forward_backward with the MoE hook): an MoE model's router terms
(balancing and z losses) included. It backwarded the LM loss alone, so a validated MoE layout trained without them.

One 2-rank job (debug-moe, moe.aux_loss 0.01, moe.z_loss 0.001; dp_shard 2, 2 micro-batches): the gradients of
every parameter after validation's step against those after the training step's micro-batches from the same model,
and the routers' gradients against the loss written out by hand, and against the LM loss alone, which must differ."""

import types

import pytest

from longctx.config import to_dict
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned_many
from longctx.planner.validate import Case, case_config

CASE = Case("dp2 moe", "debug-moe", 256, MeshShape(dp_shard=2), global_batch=4, grad_accum=2)


def _grads(model) -> dict:
    return {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}


def _validation(raw):
    from longctx.planner.validate_ranks import setup_case, train_step

    job = setup_case(raw)
    train_step(*job, zero_grad=False)  # (the optimizer step leaves the gradients as they were)
    return _grads(job[2])


def _training(raw):
    """train/step_run.py forward_backward, as a Trainer runs it (its MoE step hook installed), on validation's
    model, batch and micro-batches."""
    import torch

    from longctx.parallel.fsdp.shard import grad_scale
    from longctx.planner.validate_ranks import micro_batches, setup_case
    from longctx.train.hooks import StepHooks
    from longctx.train.moe_hooks import moe_step_hooks
    from longctx.train.step_run import forward_backward

    cfg, rt, model, _, batch, _ = setup_case(raw)
    trainer = types.SimpleNamespace(rt=rt, model=model, cfg=cfg, autocast_dtype=None, device=torch.device("cpu"),
                                    hooks=StepHooks(moe_step_hooks(cfg, model, rt)),
                                    step_counts=types.SimpleNamespace(micro_batch=lambda i, n: None))
    assert grad_scale(rt.dims) == 2.0 and len(trainer.hooks.hooks) == 1
    forward_backward(trainer, 1, micro_batches(cfg, rt, batch), batch.valid_tokens)
    return _grads(model)


def _by_hand(raw, router_terms: bool):
    """The micro-batches' summed LM loss over the step's labels, plus (router_terms) each one's router terms as
    training means them: over the step's micro-batches, times the gradient scale (grad_scale: the world size)."""
    from longctx.planner.validate_ranks import micro_batches, setup_case
    from longctx.step.loss import forward_loss_sum

    cfg, rt, model, _, batch, scale = setup_case(raw)
    micro = micro_batches(cfg, rt, batch)
    for local in micro:
        loss = forward_loss_sum(model, local, None) * scale
        (loss + model.router_terms().loss * (2.0 / len(micro)) if router_terms else loss).backward()
    return _grads(model)


@pytest.fixture(scope="module")
def runs():
    raw = to_dict(case_config(CASE))
    assert raw["model"]["preset"] == "debug-moe"
    return run_spawned_many(2, [("validation", _validation, (raw,)), ("training", _training, (raw,)),
                                ("by_hand", _by_hand, (raw, True)), ("lm_only", _by_hand, (raw, False))])


def test_validation_step_gradients_are_the_training_steps(runs):
    import torch

    for validated, trained in zip(runs["validation"], runs["training"]):
        assert validated.keys() == trained.keys()
        assert any("router" in name for name in validated)
        for name in validated:
            assert torch.equal(validated[name], trained[name]), name


def test_the_router_terms_move_the_routers(runs):
    """The routers' gradients are the LM loss's and the router terms' (meant over the micro-batches), written out
    by hand; without the router terms (the step before) they are others."""
    import torch

    validated, by_hand, lm_only = runs["validation"][0], runs["by_hand"][0], runs["lm_only"][0]
    routers = [name for name in validated if "router" in name]
    assert routers and all(torch.allclose(validated[n], by_hand[n], rtol=1e-5, atol=1e-9) for n in routers)
    assert all(not torch.allclose(validated[n], lm_only[n], rtol=1e-4, atol=1e-7) for n in routers)
