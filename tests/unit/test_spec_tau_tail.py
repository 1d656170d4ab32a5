"""Speculative decoding's tau is tokens emitted per target pass: every decoded token comes from one pass
(the first from the prefill), so tau x passes = the tokens decoded after the first (an EOS counted). A
row that ends inside its last pass (its limit, an EOS, a stop string) leaves that pass's later kept
proposals verified but not emitted; tau once counted them (a self-draft at K = 4 and 7 new tokens: 5.0
tokens per pass reported, 3.0 emitted). The acceptance rate, a property of the draft, still counts them."""

import pytest
from test_speculative import _model, _prompt

from longctx.generate.drafters import ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.speculative import speculative_generate


def decoded(r) -> int:
    return len(r.tokens) + (r.finish_reason == "eos") - 1


@pytest.mark.parametrize("new", [5, 6, 7, 9, 13])
def test_tau_counts_the_tokens_the_passes_emitted_at_any_limit(new):
    target = _model(1)
    prompt = _prompt(20, seed=3)
    spec = speculative_generate(target, ModelDrafter(target, 60), prompt, max_new_tokens=new, k=4)
    assert len(spec.tokens) == new and spec.finish_reason == "length"
    assert spec.tau * spec.passes == pytest.approx(decoded(spec))
    # a self-draft keeps every proposal: the passes are whole rounds of 5 tokens and one partial one
    assert spec.passes == -(-(new - 1) // 5) and spec.unused == (-(new - 1)) % 5


def test_tau_counts_the_tokens_emitted_up_to_an_eos_or_a_stop():
    target = _model(1)
    prompt = _prompt(20, seed=3)
    plain = generate(target, [prompt], max_new_tokens=30)[0].tokens
    spec = speculative_generate(target, ModelDrafter(target, 80), prompt, max_new_tokens=30, k=4, eos_ids=[plain[7]])
    assert spec.finish_reason == "eos" and spec.tokens == plain[:plain.index(plain[7])]
    assert spec.tau * spec.passes == pytest.approx(decoded(spec))
    stopped = speculative_generate(target, ModelDrafter(target, 80), prompt, max_new_tokens=30, k=4,
                                   stop=lambda _i, out: len(out) == 8)
    assert stopped.finish_reason == "stop" and len(stopped.tokens) == 8
    assert stopped.tau * stopped.passes == pytest.approx(decoded(stopped))
