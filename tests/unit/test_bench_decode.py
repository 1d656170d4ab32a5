"""`longctx bench decode`'s prompts, on the host before any model (the command end to end:
tests/e2e/test_generate_cli.py)."""

from types import SimpleNamespace

import pytest

from longctx.bench.decode import _prompts
from longctx.data.tokenizer import ByteTokenizer
from longctx.errors import ConfigError, DataError

TOK = ByteTokenizer()


def test_bench_decode_prompts_of_every_length_continue_the_same_text(tmp_path, capsys):
    for i, n in enumerate((50, 130, 260, 64)):  # the first is too short: 3 prompts per length, one per document
        (tmp_path / f"{i}.py").write_text("".join(chr(97 + (i + j) % 26) for j in range(n)))
    args = SimpleNamespace(prompts="", data=str(tmp_path / "*.py"), lengths="16,64", samples=8)
    prompts = _prompts(args, TOK, "byte")
    assert sorted(prompts) == [16, 64] and len(prompts[64]) == 3 == len(prompts[16])
    for i, (short, long) in zip((1, 2, 3), zip(prompts[16], prompts[64])):
        assert len(long) == 64 and short == long[-16:] and bytes(long[:2]) == bytes([97 + i, 98 + i])
    assert "holds 3 documents of 64 tokens or more, not the 8 asked" in capsys.readouterr().err
    with pytest.raises(DataError, match="needs a document of that many tokens"):
        _prompts(SimpleNamespace(prompts="", data=str(tmp_path / "0.py"), lengths="64", samples=1), TOK, "byte")


@pytest.mark.parametrize("lengths, samples, message", [("0,64", 1, "not a positive token count"),
                                                       ("-8", 1, "not a positive token count"),
                                                       ("64", 0, "at least one prompt")])
def test_bad_lengths_and_samples_are_refused(tmp_path, lengths, samples, message):
    (tmp_path / "a.py").write_text("x" * 100)
    with pytest.raises(ConfigError, match=message):
        _prompts(SimpleNamespace(prompts="", data=str(tmp_path / "a.py"), lengths=lengths, samples=samples), TOK,
                 "byte")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")
def test_a_gpu_asked_for_where_there_is_none_is_refused_before_work():
    from longctx.bench.decode import main

    with pytest.raises(ConfigError, match="--device=cuda but no CUDA device is available"):
        main(SimpleNamespace(threads=0, device="cuda", dtype="fp32", repeats=1))


@pytest.mark.parametrize("temperature, expected", [(0.0, True), (1.0, None)])
def test_identical_is_compared_only_when_decoding_is_greedy(temperature, expected):
    """At T > 0 speculative sampling keeps plain sampling's distribution, not its seeded tokens: the
    figure is null there (it read true whatever the tokens were)."""
    import torch

    from longctx.bench.decode import _all_identical, _time_prompt
    from longctx.config import ModelConfig
    from longctx.generate.sampling import Sampling
    from longctx.models.llama import build_model

    cfg = ModelConfig(dim=32, layers=1, heads=2, kv_heads=1, ffn_dim=64, vocab_size=64)
    target, draft = build_model(cfg, seed=0).eval(), build_model(cfg, seed=1).eval()
    args = SimpleNamespace(repeats=1, max_new_tokens=6, speculate=2, draft_window=0, cost=0.1, verify_cost=0.0,
                           confidence_stop=0.0)
    with torch.no_grad():
        timed = _time_prompt(args, target, draft, list(range(1, 9)), Sampling(temperature=temperature, seed=0),
                             [(None, False)])
    assert timed[0]["identical"] is expected
    assert _all_identical(True, None) is None and _all_identical(None, True) is None
    assert _all_identical(True, False) is False and _all_identical(True, True) is True
