"""The eval JSON's head records what reproduces and qualifies a result: --seed, the depths of passkey / needle,
and the notes said before work (a length past the positions the model reaches: eval/request.py reach_notes).
They went to stdout only: a result saved to compare with published figures could not show that a length was
extrapolated, and a retrieval result could not be rebuilt from its JSON (the eval94 audit)."""

import argparse

import torch

from longctx.config import load_config
from longctx.eval.request import EvalRequest
from longctx.eval.results import _result_head

PAST = "length 8,192 runs past the 4,096 positions the model reaches (its checkpoint's train.seq_len)"


def _head(task: str, notes: tuple) -> dict:
    cfg = load_config(None, [])
    request = EvalRequest(cfg, task, [8192], [0.0, 0.5] if task != "ppl" else [], {}, "text", "byte", 1, notes=notes)
    return _result_head(request, argparse.Namespace(checkpoint="ckpt", seed=7), cfg, {"world": 1}, torch.float32)


def test_a_retrieval_result_records_its_seed_depths_and_the_reach_note():
    out = _head("passkey", (PAST,))
    assert out["seed"] == 7 and out["depths"] == [0.0, 0.5] and out["notes"] == [PAST]


def test_a_ppl_result_without_notes_has_no_notes_or_depths():
    out = _head("ppl", ())
    assert out["seed"] == 7 and "depths" not in out and "notes" not in out
