"""A draft's reduced vocabulary (models/draft_vocab.py, `draft.vocab`):
- the N most frequent ids of the counts, ascending (ties to the lower id), and the share they cover;
- logits put back on the full vocabulary: -inf elsewhere, so the softmax is the subset's softmax there
  and 0 elsewhere; labels outside the subset are ignored;
- a GliDe draft with a reduced vocabulary scores exactly the target head's rows of those ids (its
  full-vocabulary twin's logits there), and speculative decoding with it is plain greedy decoding,
  tokens outside the draft's vocabulary included (the target decides)."""

import torch

from longctx.config import load_config
from longctx.generate.drafters import GlideDrafter
from longctx.generate.engine import generate
from longctx.generate.speculative import speculative_generate
from longctx.models.draft_vocab import DraftVocab
from longctx.models.glide import GlideDraft, block_stale_visible
from longctx.models.llama import build_model
from longctx.ops.loss import IGNORE


def test_the_most_frequent_ids_are_chosen_ascending():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    vocab = DraftVocab(3)
    covered = vocab.set_from_counts(counts)
    assert vocab.ids.tolist() == [2, 3, 5]  # 9, 9, 7
    assert abs(covered - 25 / 33) < 1e-9
    tie = DraftVocab(2)
    tie.set_from_counts(torch.tensor([4, 4, 4, 1]))
    assert tie.ids.tolist() == [0, 1]


def test_full_logits_and_labels():
    vocab = DraftVocab(3)
    vocab.ids.copy_(torch.tensor([1, 4, 6]))
    sub = torch.tensor([[0.5, -1.0, 2.0]])
    full = vocab.full_logits(sub, 8)
    probs = torch.softmax(full, -1)
    assert torch.allclose(probs[0, [1, 4, 6]], torch.softmax(sub[0], -1))
    assert probs[0, [0, 2, 3, 5, 7]].abs().max() == 0
    labels = torch.tensor([4, 0, 6, IGNORE, 1, 7])
    assert vocab.labels(labels, IGNORE, 8).tolist() == [1, IGNORE, 2, IGNORE, 0, IGNORE]


def test_a_reduced_draft_scores_the_targets_rows_and_decodes_losslessly():
    target = build_model(load_config(overrides=["--model.layers=3"]).model, seed=1).eval()
    full = GlideDraft(target.cfg, layers=1).init_weights(seed=4, std=0.05)
    reduced = GlideDraft(target.cfg, layers=1, vocab=40)
    reduced.load_state_dict({**full.state_dict(), "vocab.ids": torch.arange(0, 80, 2)})
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    from longctx.generate.local import prefill
    from longctx.models.kv_cache import KVCache

    with torch.inference_mode():
        cache = KVCache.for_model(target, 1, 12)
        prefill(target, cache, tokens, 64)
        kv = [(cache.k[i], cache.v[i]) for i in full.target_layers]
        args = (target, tokens, torch.arange(12)[None], kv, block_stale_visible(12, 4)[None])
        want, got = full(*args)[0], reduced(*args)[0]
    ids = torch.arange(0, 80, 2)
    assert torch.allclose(got[:, ids], want[:, ids], atol=1e-6, rtol=0)
    outside = torch.ones(target.cfg.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()
    prompt = tokens[0].tolist()
    plain = generate(target, [prompt], max_new_tokens=30)[0].tokens
    assert any(t % 2 or t >= 80 for t in plain)  # the target writes tokens the draft cannot propose
    spec = speculative_generate(target, GlideDrafter(reduced, target, 12 + 30 + 6, block=4), prompt,
                                max_new_tokens=30, k=4)
    assert spec.tokens == plain


def test_a_reduced_drafts_cape_tree_holds_only_its_vocabulary():
    """CaPE's alternatives are the draft's next most likely tokens: of a 2-token vocabulary, the one
    beside the chain's, never ids the draft gives probability 0 (before: topk filled a table of 3
    alternatives with ids 0 and 1, outside the vocabulary, verified for nothing)."""
    from longctx.generate.cape import CapeTable, propose_tree
    from longctx.generate.local import prefill
    from longctx.models.kv_cache import KVCache

    target = build_model(load_config(overrides=["--model.layers=2"]).model, seed=1).eval()
    draft = GlideDraft(target.cfg, layers=1, vocab=2).init_weights(seed=4, std=0.05)
    draft.vocab.ids.copy_(torch.tensor([3, 9]))
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    prompt, table = tokens[0].tolist(), CapeTable.parse("1:3")
    with torch.inference_mode():
        cache = KVCache.for_model(target, 1, 64)
        prefill(target, cache, tokens[:, :-1], 64)
        drafter = GlideDrafter(draft, target, 64, block=4)
        drafter.start(prompt, cache)
        tree = propose_tree(drafter, prompt[-1], 3, table)
    assert set(tree.tokens[1:]) <= {3, 9}, tree.tokens
    assert [tree.depths.count(depth) for depth in (1, 2, 3)] == [2, 2, 2]  # the chain's token and the other id
    plain = generate(target, [prompt], max_new_tokens=20)[0].tokens
    spec = speculative_generate(target, GlideDrafter(draft, target, 12 + 20 + 16, block=4), prompt,
                                max_new_tokens=20, k=3, cape=table)
    assert spec.tokens == plain
