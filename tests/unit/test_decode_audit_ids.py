"""A prompt token id outside the model's vocabulary, given to the library's generate or speculative_generate
(the command checks its prompts: generate/prompts.py), was looked up in the embedding as it was: on a CPU an
IndexError "index out of range in self" from inside the prefill, which names neither the prompt nor the id;
on a GPU a device-side assert that leaves the process's CUDA context unusable. generate/loop.py decode (every
entry point's loop) now refuses it before any work, naming the prompt, the id and the vocabulary."""

import pytest
import torch

from longctx.config import load_config
from longctx.generate.drafters import ModelDrafter
from longctx.generate.engine import generate
from longctx.generate.speculative import speculative_generate
from longctx.models.llama import build_model


def _model(layers=2, seed=1):
    return build_model(load_config(overrides=[f"--model.layers={layers}"]).model, seed=seed).eval()


@pytest.mark.parametrize("bad", [320, 10_000, -1])
def test_a_prompt_id_outside_the_vocabulary_is_refused_by_name(bad):
    model = _model()
    vocab = model.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"prompt 1 has token id {bad}.*vocabulary of {vocab}"):
        generate(model, [[1, 2, 3], [4, bad, 5]], max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"prompt 0 has token id {bad}.*vocabulary of {vocab}"):
        speculative_generate(model, ModelDrafter(_model(1, 2), 16), [bad, 1], max_new_tokens=2, k=2)


def test_ids_inside_the_vocabulary_decode():
    model = _model()
    vocab = model.cfg.vocab_size
    out = generate(model, [[0, vocab - 1], [torch.tensor(5).item()]], max_new_tokens=2)
    assert [len(r.tokens) for r in out] == [2, 2]


@pytest.mark.parametrize("draft_vocab", [300, 400])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_of_another_vocabulary_is_refused_by_name(draft_vocab, temperature):
    """The library's speculative_generate with a plain draft of another vocabulary: an IndexError (a larger
    one's proposal indexes the target's logits) or a size mismatch of q and p (sampling), from inside a round;
    a smaller one decoded greedily without a word. The command refuses such a --draft (drafts.py)."""
    from longctx.generate.sampling import Sampling

    target = _model()
    draft = build_model(load_config(overrides=["--model.layers=1", f"--model.vocab_size={draft_vocab}"]).model,
                        seed=2).eval()
    with pytest.raises(ValueError, match=f"vocabulary of {draft_vocab} tokens but the target has 320"):
        speculative_generate(target, ModelDrafter(draft, 40), [1, 2, 3], max_new_tokens=8, k=3,
                             sampling=Sampling(temperature, seed=1))
