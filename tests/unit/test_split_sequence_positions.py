"""A model whose rows parallelize() split over sequence-parallel ranks (each rank a zigzag or document share)
must be given its tokens' positions: its fallback of 0..n-1 over the share would rotate them by the wrong
angles, silently (a library caller of the parallelized model)."""

import pytest
import torch

from longctx.config import ModelConfig
from longctx.models.llama import Llama
from longctx.parallel import parallelize


def test_a_split_model_refuses_a_forward_without_positions(monkeypatch):
    model = Llama(ModelConfig(dim=32, layers=1, heads=2, kv_heads=2, ffn_dim=64, vocab_size=50))
    tokens = torch.randint(0, 50, (1, 8))
    model.hidden_states(tokens)  # one process: 0..n-1 are the positions
    monkeypatch.setattr(parallelize, "sequence_parallel_core", lambda dims, mesh: model.layers[0].attention.core)
    parallelize.use_sequence_parallel_attention(model, None, None)
    with pytest.raises(ValueError, match="pass each token's positions"):
        model.hidden_states(tokens)
    model.hidden_states(tokens, positions=torch.arange(8).unsqueeze(0))
