"""Layer lists in the config ("0,3-5": model.moe.dense_layers) and the MoE layers they leave: pure, no
torch, read by the config, its rules, the Hugging Face export and the checkpoint manifest."""

from __future__ import annotations

import functools


def parse_layer_list(text: str) -> set[int]:
    """"0,3-5" -> {0, 3, 4, 5}; "" -> set(). ValueError names what it could not read."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"cannot read '{part}' as a layer or a range of layers (write e.g. \"0,3-5\")") from None
        if first < 0 or last < first:
            raise ValueError(f"'{part}' is not a layer range (write first-last, first <= last, both >= 0)")
        out.update(range(first, last + 1))
    return out


@functools.lru_cache(maxsize=256)
def moe_layer_ids(layers: int, is_moe: bool, dense_layers) -> tuple[int, ...]:
    """ModelConfig.moe_layer_ids, computed once per (layers, dense_layers): the planner asks for it
    in every candidate's estimate."""
    if not is_moe:
        return ()
    dense = parse_layer_list(dense_layers)
    return tuple(i for i in range(layers) if i not in dense)
