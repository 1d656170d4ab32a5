"""InfLLM's unit choice on a repeating prompt (models/context_memory.py top_units): units whose
representatives are alike tie in exact arithmetic, and fp32 used to order them by rounding noise that
differs with the batch's shape, so a prompt's sample 0 of --num-samples 2 left the tokens it gives alone
(the 9th token of a 680-token prompt of the command line's tiny Llama; its log-probability off by 1.7).
Near-ties now go to the earlier unit wherever the scores are computed."""

import math

import torch

from longctx.config import load_config
from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.models.context_memory import InfLLMShape
from longctx.models.llama import build_model


def _model():
    overrides = ["--model.layers=2", "--model.vocab_size=320", "--model.max_seq_len=2048", "--model.dim=64",
                 "--model.heads=4", "--model.kv_heads=2", "--model.ffn_dim=160"]
    return build_model(load_config(overrides=overrides).model, seed=1).eval()


def test_sample_zero_of_a_repeating_prompt_is_the_prompt_alone():
    model = _model()
    pattern = torch.randint(0, 320, (29,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = (pattern * 30)[:680]
    shape = InfLLMShape(16, 2, 2, 64, 8)  # block, repr, topk, window, init
    sampling = Sampling(temperature=0.9, seed=2)

    def run(samples):
        return generate(model, [prompt], max_new_tokens=24, backend=InfLLMGeneration(shape), sampling=sampling,
                        num_samples=samples, logprobs=0)[0]

    alone, first = run(1), run(2)
    assert first.tokens == alone.tokens
    assert max(abs(a - b) for a, b in zip(first.logprobs, alone.logprobs)) <= 1e-5


def test_near_ties_go_to_the_earlier_unit():
    from longctx.models.context_memory import top_units

    scores = torch.tensor([[0.5, -0.20310387, 0.1, -0.20310384, -math.inf],
                           [-0.20310384, 0.3, -0.20310387, -math.inf, 0.29]])
    assert top_units(scores, 2).tolist() == [[0, 2], [1, 4]]
    assert top_units(scores[:, :4], 3).tolist() == [[0, 1, 2], [0, 1, 2]]  # the tie: the earlier unit
    assert top_units(scores[:1, :2], 8).tolist() == [[0, 1]]  # fewer units than topk: all of them
