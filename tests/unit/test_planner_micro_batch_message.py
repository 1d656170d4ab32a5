"""When no candidate exists because no --micro-batch size divides a data-parallel rank's share of the
global batch, the planner used to blame the sequence length ("must be divisible by 2 x head x ctx")
although the sequence divides fine; it now names the micro-batch sizes."""

from longctx.config import load_config
from longctx.costs.hardware import get_hardware
from longctx.planner.search import Request, plan


def _suggestions(**kw):
    model = load_config(None, ["--model.preset=debug"]).model
    return plan(Request(model, get_hardware("h100"), 8, 4096, **kw)).suggestions


def test_micro_batch_too_large_is_named():
    text = " ".join(_suggestions(global_batch=8, micro_batches=(16,)))
    assert "micro-batch" in text and "divisible by 2 x head x ctx" not in text


def test_sequence_that_no_layout_divides_is_still_named():
    model = load_config(None, ["--model.preset=debug"]).model
    text = " ".join(plan(Request(model, get_hardware("h100"), 8, 4097)).suggestions)
    assert "divisible by 2 x head x ctx" in text
