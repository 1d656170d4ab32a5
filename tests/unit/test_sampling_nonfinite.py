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


def _nan_model(seed=1):
    model = build_model(load_config(overrides=["--model.layers=1"]).model, seed=seed).eval()
    with torch.no_grad():
        model.output.weight.fill_(float("nan"))
    return model


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "masked"])
def test_greedy_on_logits_that_are_no_distribution_is_an_error_not_a_token(bad):
    """Greedy decoding took the argmax of NaN logits silently (the NaN's index, or 0); now the row is
    UNCHOSEN on the device and the decode loop's host read raises."""
    from longctx.generate.sampling import UNCHOSEN, greedy_choice

    logits = LOGITS.repeat(3, 1)
    if bad == "masked":
        logits[1] = float("-inf")
    else:
        logits[1, 2] = bad
    assert greedy_choice(logits).tolist() == [0, UNCHOSEN, 0]
    masked_some = LOGITS.clone()
    masked_some[0, 0] = float("-inf")  # a processor's -inf (min_new_tokens) is a distribution still
    assert greedy_choice(masked_some).tolist() == [1]
    with pytest.raises(NonFiniteLogits, match="not finite"):
        generate(_nan_model(), [[1, 2, 3]], max_new_tokens=4)


@pytest.mark.parametrize("mode", ["greedy", "sampled", "cape"])
def test_speculative_decoding_with_a_nan_target_is_an_error(mode):
    """The rejection rule kept every proposal of a NaN target (a NaN ratio compares as "keep"), and greedy
    verification matched the NaN's argmax; each is an error now. A NaN draft under greedy only costs
    its proposals: the output is plain greedy decoding's."""
    from longctx.generate.cape import CapeTable
    from longctx.generate.drafters import ModelDrafter
    from longctx.generate.speculative import speculative_generate

    healthy = build_model(load_config(overrides=["--model.layers=1"]).model, seed=1).eval()
    sampling = Sampling(temperature=1.0) if mode == "sampled" else Sampling()
    generator = torch.Generator().manual_seed(0) if mode == "sampled" else None
    cape = CapeTable.parse("0.5:2,1:1") if mode == "cape" else None
    with pytest.raises(NonFiniteLogits, match="target's logits are not finite|not finite"):
        speculative_generate(_nan_model(), ModelDrafter(healthy, 40), [1, 2, 3], max_new_tokens=6, k=3,
                             sampling=sampling, generator=generator, cape=cape)
    if mode == "sampled":  # a NaN draft's q enters the ratio: an error too
        with pytest.raises(NonFiniteLogits, match="draft's logits are not finite"):
            speculative_generate(healthy, ModelDrafter(_nan_model(), 40), [1, 2, 3], max_new_tokens=6, k=3,
                                 sampling=sampling, generator=generator)
    else:
        spec = speculative_generate(healthy, ModelDrafter(_nan_model(), 40), [1, 2, 3], max_new_tokens=6, k=3,
                                    cape=cape)
        assert spec.tokens == generate(healthy, [[1, 2, 3]], max_new_tokens=6)[0].tokens


def test_a_draft_token_is_drawn_as_multinomial_draws_it_and_a_nan_draft_is_an_error():
    """The draft's sampled step reads its token and q's finiteness in one transfer (drafters._sampled):
    the same token as torch.multinomial from the same generator state, and a NaN q an error."""
    from longctx.generate.drafters import _sampled

    q = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(3)), dim=0)
    for seed in range(20):
        want = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed)))
        assert _sampled(q, torch.Generator().manual_seed(seed)) == want
    bad = q.clone()
    bad[7] = float("nan")
    with pytest.raises(NonFiniteLogits, match="draft"):
        _sampled(bad, torch.Generator().manual_seed(0))
