"""Drafts and training-free positions against references written here (an audit for silent wrong results):
- distillation (draft.loss = kd, GliDe and Clover, with and without a reduced vocabulary, packed
  documents, temperature != 1): the cross-entropy of the draft's tempered distribution against the
  target's own tempered next-token distribution at the SAME position (both predict the token after
  it), over the labelled positions only, equals a float64 sum written out here from the target's
  logits; ce with a reduced vocabulary scores only the labels inside it, against the subset softmax;
- GliDe training reads target layer L - N + i's keys and values (as a layer-by-layer run computes
  them) with block-stale limits, and no draft output depends on a target key of another document or
  at / after its block's start (gradients);
- Clover: a position's state depends on the target's hidden states only before its round's start
  (same document, the one just before included) and on the tokens of its round up to its own
  (gradients): no step sees the token it predicts;
- Ms-PoE with 4 kv heads: each layer's ratios are spaced over [min, max] by an outlier ranking computed
  here in float64 (its own RoPE), the most position-aware kv head getting min (a permutation that is
  not its own inverse, which 2 heads cannot tell apart);
- the reduced vocabulary: ids the N most frequent REAL tokens of the training split (padding, the pad
  token repeated, is not data), ascending and distinct; logits and labels map through them and back;
  its cached head rows follow the ids and the weight they were taken from;
- a Clover draft (kd, reduced vocabulary, temperature 2) resumed at step 2 gives the uninterrupted
  run's losses."""

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

import longctx.models.glide as glide_module
from longctx.config import ModelConfig, load_config
from longctx.models.clover import CloverDraft
from longctx.models.draft_vocab import DraftVocab
from longctx.models.glide import GlideDraft
from longctx.models.llama import build_model, rope_cos_sin
from longctx.ops.loss import IGNORE
from longctx.train.glide import CloverTraining, FrozenHead, GlideTraining

LENGTHS = [9, 3, 14]  # packed documents of one row
BLOCK = 4
VOCAB = 96


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _target(layers=2):
    cfg = load_config(overrides=[f"--model.layers={layers}", "--model.dim=64", "--model.heads=4", "--model.kv_heads=2",
                                 "--model.ffn_dim=128", f"--model.vocab_size={VOCAB}"]).model
    target = build_model(cfg, seed=1).eval().requires_grad_(False)
    target.output.weight.mul_(20)  # peaked distributions (a tiny random model's are nearly uniform)
    return target


def _head(target):
    return FrozenHead(target.tok_embeddings.weight.detach().clone(), target.output.weight.detach().clone())


def _packed(seed=3):
    """tokens, positions, doc ids, labels [1, S] of LENGTHS packed (labels: the next token of the same
    document, IGNORE at each document's last token)."""
    s = sum(LENGTHS)
    tokens = torch.randint(0, VOCAB, (1, s), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None]
    labels = torch.full((1, s), IGNORE)
    start = 0
    for n in LENGTHS:
        labels[0, start:start + n - 1] = tokens[0, start + 1:start + n]
        start += n
    return tokens, positions, doc, labels


def _doc_starts():
    return torch.cat([torch.full((n,), sum(LENGTHS[:i])) for i, n in enumerate(LENGTHS)])


def _training(kind, target, vocab, loss, temperature=1.0):
    g = torch.Generator().manual_seed(5)
    if kind == "glide":
        draft, cls = GlideDraft(target.cfg, 1, vocab).init_weights(seed=2, std=0.1), GlideTraining
    else:
        draft, cls = CloverDraft(target.cfg, vocab).init_weights(seed=2, std=0.1), CloverTraining
    if vocab:
        draft.vocab.ids.copy_(torch.sort(torch.randperm(VOCAB, generator=g)[:vocab]).values)
    return cls(draft, target, _head(target), loss=loss, block=BLOCK, kd_temperature=temperature)


# ------------------------------------------------------------------------------------------------
# the losses


@pytest.mark.parametrize("kind", ["glide", "clover"])
@pytest.mark.parametrize("vocab", [0, 40])
def test_kd_is_the_cross_entropy_against_the_targets_tempered_distribution_at_the_same_position(kind, vocab):
    target = _target()
    temperature = 1.7
    model = _training(kind, target, vocab, "kd", temperature)
    tokens, positions, doc, labels = _packed()
    with torch.no_grad():
        got = float(model(tokens, positions, doc, labels, "sum"))
        mean = float(model(tokens, positions, doc, labels, "mean"))
        student = model(tokens, positions, doc).double()[0]     # the draft's logits (-inf outside a vocabulary)
        teacher = target(tokens, positions, doc).double()[0]    # the target's own logits, not the captured states
    ids = model.draft.vocab.ids if vocab else torch.arange(VOCAB)

    def reference(shift):
        total = 0.0
        for t in range(tokens.shape[1]):
            if labels[0, t] == IGNORE or not 0 <= t + shift < tokens.shape[1]:
                continue
            p = torch.softmax(teacher[t + shift, ids] / temperature, -1)   # restricted, renormalised
            log_q = torch.log_softmax(student[t, ids] / temperature, -1)
            total -= float((p * log_q).sum())
        return total

    want = reference(0)
    assert abs(got - want) < 1e-4 * abs(want), (got, want)
    assert abs(mean - want / int((labels != IGNORE).sum())) < 1e-5
    # a teacher one position off (the label's position instead of the prediction's) is another number
    assert abs(reference(1) - want) > 1.0


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_ce_with_a_reduced_vocabulary_scores_only_the_labels_inside_it(kind):
    target = _target()
    model = _training(kind, target, 40, "ce")
    tokens, positions, doc, labels = _packed()
    ids = model.draft.vocab.ids.tolist()
    with torch.no_grad():
        got = float(model(tokens, positions, doc, labels, "mean"))
        student = model(tokens, positions, doc).double()[0]
    terms = [-float(torch.log_softmax(student[t, ids], -1)[ids.index(int(labels[0, t]))])
             for t in range(tokens.shape[1]) if int(labels[0, t]) in ids]
    assert 3 <= len(terms) < int((labels != IGNORE).sum())  # some labels outside the vocabulary
    assert abs(got - sum(terms) / len(terms)) < 1e-5


# ------------------------------------------------------------------------------------------------
# what the drafts read


def test_glide_training_reads_the_named_target_layers_keys_block_stale(monkeypatch):
    target = _target(layers=3)
    draft = GlideDraft(target.cfg, 2).init_weights(seed=2, std=0.1)
    model = GlideTraining(draft, target, _head(target), block=BLOCK)
    tokens, positions, doc, _ = _packed()
    seen = []
    plain = glide_module.cross_attention

    def record(q, k, v, visible, **kw):
        seen.append((k, v, visible, kw))
        return plain(q, k, v, visible, **kw)

    monkeypatch.setattr(glide_module, "cross_attention", record)
    with torch.no_grad():
        model(tokens, positions, doc)
        cos, sin = rope_cos_sin(positions, target.inv_freq)
        x, layer_kv = target.tok_embeddings(tokens), []
        for block in target.layers:   # the target layer by layer: each layer's keys and values after RoPE
            _, k, v = block.pre(x, cos, sin)
            layer_kv.append((k.transpose(1, 2), v.transpose(1, 2)))
            x = block(x, cos, sin, doc)
    assert draft.target_layers == [1, 2]
    for i, (k, v, visible, kw) in enumerate(seen):
        want_k, want_v = layer_kv[1 + i]
        assert torch.allclose(k, want_k, atol=1e-6, rtol=0) and torch.allclose(v, want_v, atol=1e-6, rtol=0)
        assert not torch.allclose(k, layer_kv[i][0], atol=1e-3)
        assert visible[0].tolist() == [p // BLOCK * BLOCK for p in positions[0].tolist()]
        assert torch.equal(kw["q_doc"], doc) and torch.equal(kw["k_doc"], doc)


def test_a_glide_draft_reads_no_target_key_of_another_document_or_past_its_block_start():
    target = _target(layers=3)
    draft = GlideDraft(target.cfg, 2).init_weights(seed=2, std=0.1)
    tokens, positions, doc, _ = _packed()
    s = tokens.shape[1]
    g = torch.Generator().manual_seed(7)
    kv = [(torch.randn(1, 2, s, 16, generator=g).requires_grad_(), torch.randn(1, 2, s, 16, generator=g)
           .requires_grad_()) for _ in draft.target_layers]
    out = draft.hidden_states(_head(target), tokens, positions, kv, positions // BLOCK * BLOCK, doc_ids=doc,
                              key_positions=positions, key_doc_ids=doc)
    starts = _doc_starts()
    leaves = [t for pair in kv for t in pair]
    for t in range(s):
        grads = torch.autograd.grad(out[0, t].sum(), leaves, retain_graph=True)
        read = torch.stack([gr[0].abs().sum((0, 2)) > 0 for gr in grads]).any(0)
        first, limit = int(starts[t]), int(starts[t]) + int(positions[0, t]) // BLOCK * BLOCK
        allowed = torch.zeros(s, dtype=torch.bool)
        allowed[first:limit] = True
        assert not (read & ~allowed).any(), (t, torch.nonzero(read & ~allowed).flatten().tolist())
        assert read[first:limit].all()  # and it reads every key it may


def test_a_clover_state_reads_the_hidden_states_before_its_round_and_the_tokens_of_its_round():
    target = _target()
    draft = CloverDraft(target.cfg).init_weights(seed=2, std=0.1)
    tokens, positions, doc, _ = _packed()
    s = tokens.shape[1]
    with torch.no_grad():
        hidden = target(tokens, positions, doc, hidden=True)
    hidden = hidden.clone().requires_grad_()
    embedded = target.tok_embeddings(tokens).detach().clone().requires_grad_()

    class Embeddings:  # the target's embedding, as a leaf the gradient reaches
        @staticmethod
        def tok_embeddings(_):
            return embedded

    states = draft.chain_states(Embeddings, tokens, positions, hidden, BLOCK, doc)
    starts = _doc_starts()
    for p in range(s):
        d_hidden, d_tokens = torch.autograd.grad(states[0, p].sum(), [hidden, embedded], retain_graph=True)
        first = int(starts[p])
        round_start = first + int(positions[0, p]) // BLOCK * BLOCK
        read_hidden = torch.nonzero(d_hidden[0].abs().sum(-1) > 0).flatten().tolist()
        read_tokens = torch.nonzero(d_tokens[0].abs().sum(-1) > 0).flatten().tolist()
        assert read_tokens == list(range(round_start, p + 1)), p   # never p + 1, the token it predicts
        assert read_hidden == list(range(first, round_start)), p   # A[round_start - 1] and the memory before


# ------------------------------------------------------------------------------------------------
# Ms-PoE


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE in complex form, float64: x [n, heads, d], dims (j, j + d/2) one complex number."""
    d = x.shape[-1]
    angle = positions[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., :d // 2], x[..., d // 2:]) * torch.exp(1j * angle)[:, None, :]
    return torch.cat([z.real, z.imag], -1)


def test_ms_poe_ratios_follow_an_outlier_ranking_of_the_kv_heads():
    from longctx.models import ms_poe

    cfg = ModelConfig(layers=3, heads=8, kv_heads=4, dim=64, ffn_dim=128, vocab_size=VOCAB, max_seq_len=64)
    low, high = 1.1, 2.0
    model = build_model(dataclasses.replace(cfg, rope_ms_poe=True, rope_ms_poe_skip_layers=1, rope_ms_poe_min=low,
                                            rope_ms_poe_max=high), seed=0).eval()
    d = cfg.resolved_head_dim
    with torch.no_grad():  # kv heads of different sharpness, in an order that is not its own inverse
        for layer, factors in ((1, [2.0, 0.0, 8.0, 4.0]), (2, [0.0, 8.0, 2.0, 4.0])):
            attention = model.layers[layer].attention
            attention.wq.weight *= 6
            for g, f in enumerate(factors):
                attention.wk.weight[g * d:(g + 1) * d] *= f
    model.init_rope()
    # the reference: each layer's input from a plain-RoPE model with these weights, the attention here
    plain = build_model(cfg, seed=0).eval()
    plain.load_state_dict(model.state_dict())
    n = min(ms_poe.PROBE_TOKENS, cfg.max_seq_len)
    probe = torch.randint(cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(ms_poe.PROBE_SEED))
    inputs = []
    hooks = [b.register_forward_pre_hook(lambda _m, a: inputs.append(a[0][0].double())) for b in plain.layers]
    with torch.no_grad():
        plain(probe)
    for h in hooks:
        h.remove()
    pos = torch.arange(n, dtype=torch.float64)
    want = torch.ones(cfg.layers, cfg.kv_heads, dtype=torch.float64)
    for layer in range(1, cfg.layers):
        block, x = plain.layers[layer], inputs[layer]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * block.attention_norm.weight.double()
        q = _rotate((h @ block.attention.wq.weight.double().T).view(n, 8, d), pos, cfg.rope_theta)
        k = _rotate((h @ block.attention.wk.weight.double().T).view(n, 4, d), pos, cfg.rope_theta)
        share = torch.zeros(8, dtype=torch.float64)
        for head in range(8):
            for i in range(n // 2, n):  # the probe's second half of queries, each seeing i + 1 keys
                w = torch.softmax(k[:i + 1, head // 2] @ q[i, head] / math.sqrt(d), 0)
                share[head] += (w > 3.0 / (i + 1)).double().mean() / (n - n // 2)
        score = share.view(4, 2).mean(-1).tolist()
        order = sorted(range(4), key=lambda g: -score[g])  # most position-aware first
        for rank, g in enumerate(order):
            want[layer, g] = low + (high - low) * rank / 3
        if layer == 2:  # ratios[order] = spaced and ratios = spaced[order] differ only for such an order
            assert len(set(score)) == 4 and [order[g] for g in order] != list(range(4))
    assert torch.allclose(model.ms_poe_ratios.double(), want, atol=1e-6), (model.ms_poe_ratios, want)
    assert sorted(want[2].tolist()) == pytest.approx([1.1, 1.4, 1.7, 2.0])


# ------------------------------------------------------------------------------------------------
# the reduced vocabulary


def test_the_vocabulary_is_a_bijection_onto_the_most_frequent_ids():
    g = torch.Generator().manual_seed(11)
    counts = torch.randint(0, 6, (VOCAB,), generator=g)  # many ties
    vocab = DraftVocab(30)
    covered = vocab.set_from_counts(counts)
    want = sorted(sorted(range(VOCAB), key=lambda i: (-int(counts[i]), i))[:30])
    assert vocab.ids.tolist() == want
    assert abs(covered - sum(int(counts[i]) for i in want) / int(counts.sum())) < 1e-12
    sub = torch.randn(5, 30, generator=g)
    full = vocab.full_logits(sub, VOCAB)
    assert torch.equal(full[:, want], sub) and torch.isneginf(full.sum(0)[[i for i in range(VOCAB) if i not in want]]
                                                              ).all()
    # a draft id's proposal is the target id it stands for
    assert torch.equal(full.argmax(-1), torch.tensor(want)[sub.argmax(-1)])
    labels = torch.tensor([want[3], IGNORE, [i for i in range(VOCAB) if i not in want][0], want[29]])
    assert vocab.labels(labels, IGNORE, VOCAB).tolist() == [3, IGNORE, IGNORE, 29]


def test_the_head_rows_follow_ids_copied_in_place():
    vocab = DraftVocab(3)
    vocab.ids.copy_(torch.tensor([1, 4, 7]))
    weight = torch.randn(10, 5)
    with torch.no_grad():
        assert torch.equal(vocab.head(weight), weight[[1, 4, 7]])
        vocab.ids.copy_(torch.tensor([0, 2, 9]))  # as load_state_dict writes a checkpoint's ids: in place
        assert torch.equal(vocab.head(weight), weight[[0, 2, 9]])
    with torch.inference_mode():  # ids made here keep no version counter: the load itself must tell
        made = DraftVocab(3)
        made.ids.copy_(torch.tensor([1, 4, 7]))
        assert torch.equal(made.head(weight), weight[[1, 4, 7]])
        made.load_state_dict({"ids": torch.tensor([3, 5, 8])})
        assert torch.equal(made.head(weight), weight[[3, 5, 8]])


def test_the_head_rows_follow_a_new_head_tensor_that_reuses_a_freed_ones_id():
    # another target's head (same shape, version, dtype, device) allocated where a freed one was
    vocab = DraftVocab(2)
    vocab.ids.copy_(torch.tensor([0, 2]))
    with torch.no_grad():
        first = torch.ones(4, 3)
        vocab.head(first)
        address = id(first)
        del first
        for fill in range(2, 200):
            other = torch.full((4, 3), float(fill))
            if id(other) == address:
                assert torch.equal(vocab.head(other), other[[0, 2]])
                return
            del other
    pytest.skip("no tensor reused the freed one's id on this interpreter")


def _word_store(d, count, seed=0):
    rng = random.Random(seed)
    d.mkdir()
    for i in range(count):
        (d / f"doc{i:03d}.txt").write_text("x" * rng.randint(20, 30) + " " + "y" * rng.randint(10, 15) + "\n")
    return [f"--data.corpus={d}", "--data.tokenizer=byte"]


def test_the_vocabulary_of_instruction_data_counts_its_answers_not_its_prompts(tmp_path):
    # prompts of capitals and digits, answers of small letters: the draft proposes answers, so its vocabulary
    # is theirs (counted over every token, the prompts' letters were the most frequent)
    from test_instruction_pairs import _build, _jsonl

    from longctx.data.loader import PackedSamples
    from longctx.data.samples import IGNORE
    from longctx.job.runtime import Runtime
    from longctx.train.glide import token_counts

    rng = random.Random(0)
    pairs = [("".join(rng.choice("ABC123") for _ in range(60)), " " + "".join(rng.choice("xyz") for _ in range(8)))
             for _ in range(30)]
    root, _ = _build(tmp_path, [_jsonl(tmp_path / "p.jsonl", pairs)], eval_fraction=0.0)
    cfg = load_config(None, [f"--data.path={root}", "--train.seq_len=256", "--metrics.progress=false"])
    counts = token_counts(cfg, Runtime(), log=lambda *a, **k: None)
    samples, want = PackedSamples(root, "train"), np.zeros(cfg.model.vocab_size, dtype=np.int64)
    for i in range(len(samples)):
        tokens, labels, _, _ = samples.sample(i)
        np.add.at(want, np.asarray(tokens)[1:][np.asarray(labels)[:-1] != IGNORE], 1)  # (each trained token)
    assert counts.tolist() == want.tolist() and want[ord("A")] == 0 and want[ord("x")] > 0
    vocab = DraftVocab(5)  # (" ", x, y, z and the EOS: every token trained on)
    assert vocab.set_from_counts(counts) == 1.0 and sorted(vocab.ids.tolist()) == [32, 120, 121, 122, 257]


def test_the_vocabulary_counts_real_tokens_not_the_padding(tmp_path):
    # few short documents in long samples: most of each sample is padding (the pad token: EOS), which
    # no label reads; the draft's vocabulary and the share it reports are the real tokens'
    from longctx.data.loader import PackedSamples
    from longctx.job.runtime import Runtime
    from longctx.train.glide import token_counts
    from longctx.train.setup import store_path

    cfg = load_config(None, [*_word_store(tmp_path / "docs", 8), "--train.seq_len=1024",
                             "--metrics.progress=false"])
    counts = token_counts(cfg, Runtime(), log=lambda *a, **k: None)
    samples = PackedSamples(store_path(cfg, lambda *a, **k: None, None), "train", True)
    want = np.zeros(cfg.model.vocab_size, dtype=np.int64)
    padding = 0
    for i in range(len(samples)):
        tokens = np.asarray(samples.sample(i)[0])
        real = int(samples.real_tokens[i])
        np.add.at(want, tokens[:real], 1)
        padding += len(tokens) - real
    assert padding > want.sum()  # the case this is about
    assert counts.tolist() == want.tolist()
    vocab = DraftVocab(3)
    covered = vocab.set_from_counts(counts)
    assert 257 not in vocab.ids.tolist()  # EOS: one per document, however much padding
    assert abs(covered - want[vocab.ids.numpy()].sum() / want.sum()) < 1e-12


# ------------------------------------------------------------------------------------------------
# resume


def test_a_clover_draft_resumes_exactly(tmp_path):
    from longctx.train.trainer import Trainer

    quiet = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=64",
             "--train.global_batch=2", "--metrics.log_interval=1", "--train.warmup_steps=1"]
    rng = random.Random(0)
    words = "def return self import class yield lambda async await with try".split()
    (tmp_path / "docs").mkdir()
    for i in range(120):
        (tmp_path / "docs" / f"d{i:03d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))))
    corpus = [f"--data.corpus={tmp_path / 'docs'}", "--data.tokenizer=byte"]

    def run(*args):
        return Trainer(load_config(None, [*quiet, *corpus, *args]), log=lambda *a, **k: None).run()

    run("--model.layers=2", "--model.dim=32", "--model.heads=2", "--model.kv_heads=1", "--model.ffn_dim=64",
        "--train.steps=2", f"--train.run_dir={tmp_path / 'target'}")
    draft = [f"--draft.target={tmp_path / 'target' / 'checkpoints'}", "--draft.kind=clover", "--draft.loss=kd",
             "--draft.vocab=40", "--draft.kd_temperature=2", "--train.steps=4", "--train.lr=3e-2"]
    full = run(*draft, f"--train.run_dir={tmp_path / 'full'}").losses
    run(*draft, "--checkpoint.interval=2", f"--train.run_dir={tmp_path / 'part'}")
    resumed = run(*draft, f"--checkpoint.resume={tmp_path / 'part' / 'checkpoints' / 'step-00000002'}",
                  f"--checkpoint.dir={tmp_path / 'again'}", f"--train.run_dir={tmp_path / 'part'}")
    assert resumed.first_step == 3 and len(resumed.losses) == 2
    assert len(set(full)) == 4  # the steps differ: the comparison is not between constants
    assert max(abs(a - b) for a, b in zip(resumed.losses, full[2:])) < 1e-6
