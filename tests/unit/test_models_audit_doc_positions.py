"""Packed documents in one row (doc_ids) give each document what a forward of that document alone gives:
RoPE positions restart at every document. The loader and every command pass the restarted positions; a library
caller that passes doc_ids alone got positions 0..seq-1 across the whole row, so a document far along the row was
rotated by angles thousands of radians large. RoPE depends on position differences only, so that agrees in exact
arithmetic, but fp32 angles lose precision with their size: a document at offset 8,000 scored 3e-4 off its own
forward (logits of order 5), growing with the row's length. Found by the models audit."""

import torch

from longctx.config import load_config
from longctx.models.llama import build_model

TOL = 1e-5


def _model(scaling=()):
    cfg = load_config(overrides=["--model.preset=debug", "--model.max_seq_len=16384", "--model.rope_theta=500000",
                                 *scaling]).model
    model = build_model(cfg, "cpu").eval()
    with torch.no_grad():  # larger weights: logits of order 5, so a few ulps of angle show
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5)
    return model


def _row(lengths, vocab, seed=0):
    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return tokens, doc_ids


def test_doc_ids_alone_restart_positions_as_separate_forwards():
    model = _model()
    lengths = (8000, 40, 300)  # the later documents sit far along the row
    tokens, doc_ids = _row(lengths, model.cfg.vocab_size)
    with torch.no_grad():
        packed = model(tokens, doc_ids=doc_ids)
        start = 0
        for n in lengths:
            alone = model(tokens[:, start:start + n])
            err = (packed[:, start:start + n] - alone).abs().max().item()
            assert err <= TOL, (n, start, err)
            start += n


def test_doc_ids_alone_equal_the_loaders_restarted_positions_under_yarn():
    model = _model(["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=64"])
    lengths = (50, 3000, 7, 200)
    tokens, doc_ids = _row(lengths, model.cfg.vocab_size, seed=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (data/loader.py's rule)
    with torch.no_grad():
        assert torch.equal(model(tokens, doc_ids=doc_ids), model(tokens, positions, doc_ids))


def test_rows_of_two_layouts_and_no_doc_ids_keep_0_to_n():
    model = _model()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.tensor([[0] * 64, [0] * 10 + [1] * 54])
    positions = torch.stack([torch.arange(64), torch.cat([torch.arange(10), torch.arange(54)])])
    with torch.no_grad():
        assert torch.equal(model(tokens, doc_ids=doc_ids), model(tokens, positions, doc_ids))
        assert torch.equal(model(tokens), model(tokens, torch.arange(64).expand(2, 64)))
