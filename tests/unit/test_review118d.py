"""Review of the planner search's `dominated` skip (helper review118d): a candidate it skips must never come before
its twin in the ranking, so the best plan of a search equals that of one that skips nothing."""

from __future__ import annotations

import argparse

import pytest

from longctx.planner import cli, search
from longctx.planner.arguments import add_arguments


def _request(argv: str):
    add_arguments(p := argparse.ArgumentParser())
    req, _ = cli.build_request(*p.parse_known_args([*argv.split(), "--no-write"]))
    return req


def _best_keys(req, monkeypatch) -> tuple[tuple, tuple]:
    """(_sort_key of the search's best plan, of the best of a search that skips nothing as dominated)."""
    best = search.plan(req, explain=False).best
    with monkeypatch.context() as m:
        m.setattr(search, "dominated", lambda *args: None)
        every = search.plan(req, explain=False).best
    return search._sort_key(best), search._sort_key(every)


def test_expert_pieces_are_tried_where_activations_are_offloaded(monkeypatch):
    """Expert pieces offload fewer bytes than whole rows: with selective+off0.25 on 8 x H100 at 16K, qwen3-30b-a3b
    in pieces takes 1.858 s, whole rows 2.180 s. They were skipped wherever whole rows fit, and the search planned
    selective lc4K gs-micro at 1.982 s."""
    req = _request("--model qwen3-30b-a3b --gpus 8 --seq-len 16K --hardware h100 --micro-batch 1 --recompute "
                   "selective --offload 0.25 --block-chunk 0 --loss-chunk 4096 --model-states device")
    best, every = _best_keys(req, monkeypatch)
    assert best == every, (best, every)
    assert search.plan(req, explain=False).best.policy.expert_chunk


@pytest.mark.parametrize("argv", [
    # one 64K attention chunk of the core's 64K tokens with its state in host memory: the same 0.02282 s as the
    # whole core, 0.485 GiB against 0.658 (0 GiB against 1, as _sort_key rounds them): it comes first
    "--model debug --gpus 1 --seq-len 64K --recompute selective --block-chunk 16384 --micro-batch 1 --offload 0",
])
def test_a_chunk_holding_fewer_gib_at_the_same_step_time_is_not_skipped(argv, monkeypatch):
    best, every = _best_keys(_request(argv), monkeypatch)
    assert best == every, (best, every)
