"""`longctx bench` audit (helper bench, 2026-12-02): lengths and names a command's own checks must refuse
before its work, instead of a JSON row of errors with exit code 0 or a traceback from inside the run."""

import re

import pytest

from longctx.errors import ConfigError


def _bench(*argv):
    from longctx.cli import build_parser

    args, _ = build_parser("bench").parse_known_args(["bench", *argv])
    return args


@pytest.mark.parametrize("argv, said", [
    # was a `longctx train` per layout refusing it, each a JSON row's "error", and exit code 0
    (("train", "--seq-len", "262144", "--layouts", "single", "--steps", "2"),
     "--seq-len 262144: preset debug holds at most 131,072 tokens"),
    (("train", "--presets", "olmoe-1b-7b", "--seq-len", "4096,8192", "--layouts", "single"),
     "--seq-len 8192: preset olmoe-1b-7b holds at most 4,096 tokens"),
    # was torch's "AssertionError: Torch not compiled with CUDA enabled" traceback from inside the run
    (("moe", "--device", "cuda"), "--device cuda: no CUDA device is available here"),
    # was ignored: the CPU run printed no compiled figure and said nothing
    (("moe", "--compile"), "--compile times the compiled layer on one GPU only"),
    # was ignored: the figures of sample 0 of N-token documents (or of no documents), said to be of sample 3
    (("attention", "--first-sample", "3"), "--first-sample 3: a store's samples, read only with --docs store:DIR"),
    (("attention", "--docs", "512", "--imbalance-samples", "8"), "--imbalance-samples 8: a store's samples"),
    # was a negative index into the store: samples from its end
    (("attention", "--docs", "store:/x", "--first-sample", "-2"), "--first-sample must be >= 0, got -2"),
    # was each rank's ConfigError traceback after the ranks were spawned (rc 1)
    (("comm", "--cluster", "2x1", "--model", "nope"), "--model nope: choose among debug"),
])
def test_bench_refuses_what_the_work_would_refuse(argv, said, monkeypatch):
    import torch

    from longctx.bench.arg_checks import check_bench_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (the same on a GPU machine)

    with pytest.raises(ConfigError, match=re.escape(said)):
        check_bench_args(argv[0], _bench(*argv))


def test_bench_train_takes_lengths_its_presets_hold():
    from longctx.bench.arg_checks import check_bench_args

    check_bench_args("train", _bench("train", "--presets", "debug,olmoe-1b-7b", "--seq-len", "4096"))


def test_bench_generate_transformers_reference_reads_a_prompt_token_zero(tmp_path):
    """bench generate's transformers run was given pad_token_id 0 and no attention mask, so transformers
    masked out every prompt token 0: at --vocab 64 (prompt [44, 47, 53, 0, ...]) same_tokens was false
    although both models' logits are equal. Its tokens must be the model's own greedy continuation."""
    import argparse

    import torch

    from longctx.bench import generate as bench_generate

    a = argparse.Namespace(dim=32, ffn_dim=64, layers=1, heads=2, kv_heads=1, vocab=64, prompt_len=8,
                           new_tokens=4, seed=0)
    model = bench_generate._random_hf_model(a, tmp_path)
    prompt = torch.tensor([[44, 47, 53, 0, 3, 59, 3, 39]])
    got = bench_generate._time_transformers(model, prompt, 4)["tokens"]
    seq = prompt
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got == seq[0, 8:].tolist()


def test_bench_moe_takes_compile_on_a_gpu(monkeypatch):
    import torch

    from longctx.bench.arg_checks import check_bench_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (gpu_speed.sh's step 2)
    check_bench_args("moe", _bench("moe", "--device", "cuda", "--compile", "--dim", "2048", "--experts", "64",
                                   "--top-k", "8", "--expert-dim", "768", "--skew-share", "0.125"))


def test_bench_generate_compile_names_the_card(monkeypatch):
    """bench generate --compile --device cuda wrote "device": "cuda" and no card (gpu_speed.sh's step 3 JSON
    did not say which GPU its 2,000 tokens/s were measured on; principle 14: JSON with the card's name)."""
    import torch

    from longctx.bench import generate as bench_generate

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert bench_generate.card_name("cuda") == "NVIDIA H200"
    assert bench_generate.card_name("cpu") not in ("", "cuda", "NVIDIA H200")
