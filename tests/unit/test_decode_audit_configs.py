"""Cached decoding through `generate` (eager and the compiled static step) against the independent reference,
the plain forward over each row's whole sequence: every new token's log-probability within 1e-5 (fp32) and
the token its argmax, for the attention variants the cache meets: GQA, MQA, qk-norm (Qwen3), YaRN, Llama-3
and linear RoPE scaling, Ms-PoE (both orders). One batch holds prompts of 40 (> --prefill-chunk 16: chunked),
5 and 13 (twice: a flat varlen prefill) tokens with different limits, so rows decode ragged and finish at
different steps. The compiled step ("eager" backend: dynamo's capture, in seconds) takes every decode step
after the first token and compiles once. No finding (the audit's): a guard on what a change could break."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from longctx.config import load_config
from longctx.generate.engine import generate
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep

CONFIGS = {
    "gqa": {}, "mqa": {"kv_heads": 1}, "qk_norm": {"family": "qwen3", "qk_norm": "true"},
    "yarn": {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_len": 32},
    "llama3": {"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_len": 32},
    "linear": {"rope_scaling": "linear", "rope_factor": 2.0},
    "ms_poe": {"rope_ms_poe": "true", "rope_ms_poe_skip_layers": 0},
    "ms_poe_attention": {"rope_ms_poe": "true", "rope_ms_poe_order": "attention", "rope_ms_poe_skip_layers": 1},
}
LIMITS = [10, 17, 6, 12]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _prompt(n, seed):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_equals_the_full_forward(name):
    overrides = ["--model.layers=2"] + [f"--model.{k}={v}" for k, v in CONFIGS[name].items()]
    model = build_model(load_config(overrides=overrides).model, seed=1).eval()
    prompts = [_prompt(40, 1), _prompt(5, 2), _prompt(13, 3), _prompt(13, 4)]
    counter = CompileCounter()
    step = CompiledStep(backend=counter)
    for compile in (False, step):
        results = generate(model, prompts, max_new_tokens=LIMITS, prefill_chunk=16, logprobs=0, compile=compile)
        assert [len(r.tokens) for r in results] == LIMITS
        with torch.inference_mode():
            for prompt, r in zip(prompts, results):
                full = torch.log_softmax(model(torch.tensor([prompt + r.tokens]))[0].float(), -1)
                rows = full[len(prompt) - 1:len(prompt) - 1 + len(r.tokens)]
                assert rows.argmax(-1).tolist() == r.tokens
                chosen = rows.gather(-1, torch.tensor(r.tokens)[:, None])[:, 0]
                assert (chosen - torch.tensor(r.logprobs)).abs().max().item() <= 1e-5
    assert step.calls == max(LIMITS) - 1 and counter.frame_count == 1
