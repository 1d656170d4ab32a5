"""CO2's outer step written by hand from the formulas (docs/parallelism.md), the reference the CO2
tests replay replicas against: the replicas' changes averaged, through outer momentum and its norm
clip. What each replica then becomes (its own progress kept, shrunk by the staleness penalty) is the
caller's."""

import torch


def outer_change(sent: list[torch.Tensor], momentum: torch.Tensor, beta: float,
                 clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the change the outer model moves by, before the outer lr; the momentum after this round) from
    each replica's change `sent`."""
    change = sum(sent) / len(sent)
    if beta > 0:
        momentum = beta * momentum + change
        change = momentum
    if clip > 0:
        change = change * min(1.0, clip / (float(change.norm()) + 1e-12))
        momentum = change if beta > 0 else momentum
    return change, momentum


def flat(model) -> torch.Tensor:
    """A model's parameters as one vector (what the outer step moves)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def write(model, vector: torch.Tensor) -> None:
    """Set a model's parameters from one vector laid out as flat() lays them."""
    with torch.no_grad():
        for p, part in zip(model.parameters(), vector.split([p.numel() for p in model.parameters()])):
            p.copy_(part.view_as(p))
