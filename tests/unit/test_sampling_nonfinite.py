"""A distribution that is not finite is an error, never a token (generate/sampling.py): NaN or inf in
the processed logits (a model's NaN, or logits / T overflowing fp32 at a tiny temperature) made every
row's CDF NaN, and the draw ran past the end of the vocabulary and was clamped to its last id.
Temperatures whose division overflows are refused with the other settings, before any work."""

import math

import pytest
import torch

from longctx.config import load_config
from longctx.errors import ConfigError, UserError
from longctx.generate.engine import generate
from longctx.generate.sampling import MIN_TEMPERATURE, NonFiniteLogits, Sampling, draw, next_tokens, row_generators
from longctx.models.llama import build_model

LOGITS = torch.tensor([[5.0, 4.0, -1.0, -2.0]])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_logits_are_an_error_not_the_last_id(bad):
    logits = LOGITS.repeat(3, 1)
    logits[1, 2] = bad
    with pytest.raises(NonFiniteLogits) as e:
        draw(logits, row_generators([0, 1, 2]))
    message = str(e.value)
    assert "row 1" in message and "not finite" in message and "--temperature 0" in message
    assert isinstance(e.value, UserError)  # the CLI prints it as one paragraph


def test_a_row_with_every_token_masked_is_an_error():
    logits = LOGITS.repeat(2, 1)
    logits[0] = float("-inf")
    with pytest.raises(NonFiniteLogits, match="row 0"):
        draw(logits, row_generators([0, 1]))


def test_a_tiny_temperature_overflowing_fp32_is_refused_before_work():
    for t in (1e-39, 1e-35, MIN_TEMPERATURE / 2):
        problems = Sampling(temperature=t).problems()
        assert len(problems) == 1 and "--temperature" in problems[0] and "--temperature 0" in problems[0], problems
        with pytest.raises(ConfigError):
            Sampling(temperature=t).check()
    assert Sampling(temperature=math.inf).problems() and Sampling(temperature=math.nan).problems()
    # an overflowing division the check cannot foresee (a logit of 1e9 at the smallest temperature): the error
    with pytest.raises(NonFiniteLogits):
        next_tokens(torch.tensor([[1e9, 0.0]]), Sampling(temperature=MIN_TEMPERATURE), row_generators([0]))


@pytest.mark.parametrize("t", [MIN_TEMPERATURE, 1e-6, 1e-4])
def test_small_temperatures_that_do_not_overflow_still_sample(t):
    """As small as allowed, sampling picks the most likely token (as greedy would), for every seed."""
    assert not Sampling(temperature=t).problems()
    drawn = [int(next_tokens(LOGITS, Sampling(temperature=t), row_generators([s]))[0]) for s in range(8)]
    assert drawn == [0] * 8


def test_generate_from_a_model_with_nan_logits_raises():
    model = build_model(load_config(overrides=["--model.layers=1"]).model, seed=1).eval()
    with torch.no_grad():
        model.output.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLogits):
        generate(model, [[1, 2, 3]], max_new_tokens=4, sampling=Sampling(temperature=1.0))
