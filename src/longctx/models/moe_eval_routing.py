"""How a MoE model routes outside training: dropless (its capacity left out) in generation and evaluation, the
note a command prints of that, and how a DTS-Gate router routes in an evaluation (moe.dts_eval)."""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from .moe import DTSRouter, moe_layers


@contextmanager
def dropless(*models: nn.Module | None):
    """Every MoE layer of `models` (None: skipped) routes without its capacity (moe.capacity_factor) inside
    the block, and keeps it after: generation's routing. A capacity is shared by the tokens of one call,
    so a token's experts would depend on the other rows of a decode batch (finished ones too), on how the
    prompt is chunked or grouped in prefill, on a verification's proposals and on the layout: a prompt's
    tokens would depend on what it runs with. Dropless, each token reaches its top k, as eval scores such a
    model (eval/request.py) and as transformers' MoE families route."""
    layers = [layer for m in models if m is not None for layer in moe_layers(m)]
    held = [layer.capacity_factor for layer in layers]
    for layer in layers:
        layer.capacity_factor = 0.0
    try:
        yield
    finally:
        for layer, capacity in zip(layers, held):
            layer.capacity_factor = capacity


def dropless_note(capacity: float, runs: str, would: str) -> str | None:
    """What a command says once of the capacity `dropless` leaves out (None: no capacity): `runs` what runs
    dropless ("the model is evaluated"), `would` what the capacity would make depend on what."""
    if not capacity > 0:
        return None
    return (f"{runs} dropless: its moe.capacity_factor {capacity:g} is left out, since a capacity is shared by the "
            f"tokens of a call and would make {would}")


def eval_routing_note(model: nn.Module) -> str | None:
    """How an evaluation of `model` routes where that depends on the step (DTS-Gate: moe.dts_eval),
    for the eval line; None for routers that route the same at every step."""
    routers = [layer.router for layer in moe_layers(model) if isinstance(layer.router, DTSRouter)]
    return routers[0].describe_eval() if routers else None
