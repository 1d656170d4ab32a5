"""GliDe draft training (train/glide.py) and its pieces:
- the block-stale cross-attention of models/glide.py with key positions and documents equals a dense
  reference built by hand (packed documents, several blocks, GQA and MQA, a rank's scattered queries
  against the whole sequence), queries that see nothing included (0, and no gradient), in values and
  in the queries' gradient; keys out of sequence order are refused;
- the distillation loss (ops/loss.py) chunked equals the plain formula, values and gradients;
- `longctx train --draft.target` on a tiny target: the loss falls over 30 steps, only the draft is
  optimised, the target gets no gradient and its weights are unchanged; the checkpoint names its
  target and loads with load_glide_draft into a draft whose logits (reading the target's KV cache)
  equal the trained module's; recompute none / selective / full train alike and a resume continues;
- bad input: draft.target missing or not a model checkpoint, loss not ce|kd, block < 1, ... are
  ConfigErrors before any work."""

import math
import random

import pytest
import torch

from longctx.checkpoint.glide import glide_manifest, load_glide_draft
from longctx.checkpoint.weights_only import load_model_weights
from longctx.config import load_config
from longctx.config.hf import HFFormatError
from longctx.errors import ConfigError
from longctx.models.glide import block_stale_limit, cross_attention
from longctx.models.llama import build_model
from longctx.ops.loss import lm_head_distill_loss
from longctx.train.trainer import Trainer

QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=128",
         "--train.global_batch=4", "--train.warmup_steps=2"]


# ------------------------------------------------------------------------------------------------
# the block-stale mask


def _packed(lengths_per_row):
    """positions (restarting per document) and document ids [rows, seq] of packed documents."""
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])
    doc = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]) for lengths in lengths_per_row])
    return pos, doc


def _reference(q, k, v, q_pos, q_doc, k_pos, k_doc, block):
    """Query i sees the keys of its document at positions < q_pos // block * block; none: 0."""
    b, n, heads, d = q.shape
    group = heads // k.shape[1]
    rows = []
    for r in range(b):
        outs = []
        for i in range(n):
            seen = (k_doc[r] == q_doc[r, i]) & (k_pos[r] < q_pos[r, i] // block * block)
            heads_out = []
            for h in range(heads):
                if not seen.any():
                    heads_out.append(torch.zeros(d))
                    continue
                keys, values = k[r, h // group][seen], v[r, h // group][seen]
                heads_out.append(torch.softmax(keys @ q[r, i, h] / math.sqrt(d), dim=0) @ values)
            outs.append(torch.stack(heads_out))
        rows.append(torch.stack(outs))
    return torch.stack(rows)


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("chunk", [5, 64])
def test_block_stale_mask_against_a_dense_reference(kv_heads, chunk):
    g = torch.Generator().manual_seed(0)
    heads, d, block = 4, 8, 4
    k_pos, k_doc = _packed([[5, 9, 2, 8], [24], [3, 11, 10]])  # 3 rows of 24 tokens
    b, S = k_pos.shape
    k, v = torch.randn(b, kv_heads, S, d, generator=g), torch.randn(b, kv_heads, S, d, generator=g)
    # all the queries, and a rank's share of them: two pieces far apart (zigzag-like), in local order
    for held in (torch.arange(S), torch.cat([torch.arange(0, 6), torch.arange(17, 24)])):
        q_pos, q_doc = k_pos[:, held], k_doc[:, held]
        q = torch.randn(b, len(held), heads, d, generator=g, requires_grad=True)
        got = cross_attention(q, k, v, block_stale_limit(q_pos, block), chunk, key_pos=k_pos, q_doc=q_doc, k_doc=k_doc)
        q_ref = q.detach().clone().requires_grad_()
        want = _reference(q_ref, k, v, q_pos, q_doc, k_pos, k_doc, block)
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        blind = q_pos < block  # the first block of each document sees no key
        assert blind.any() and (~blind).any()
        assert got[blind].abs().max() == 0
        weights = torch.randn(got.shape, generator=g)
        (got * weights).sum().backward()
        (want * weights).sum().backward()
        assert torch.isfinite(q.grad).all()
        assert torch.allclose(q.grad, q_ref.grad, atol=1e-5, rtol=0)
        assert q.grad[blind].abs().max() == 0


def test_keys_out_of_sequence_order_are_refused():
    pos, doc = _packed([[6, 6]])
    q, k = torch.randn(1, 12, 2, 4), torch.randn(1, 2, 12, 4)
    order = torch.randperm(12)
    with pytest.raises(ValueError, match="sequence order"):
        cross_attention(q, k, k, block_stale_limit(pos, 2), key_pos=pos[:, order], q_doc=doc, k_doc=doc[:, order])


def test_distillation_loss_chunked_equals_the_formula():
    g = torch.Generator().manual_seed(1)
    n, dim, vocab, t = 13, 16, 40, 2.0
    h = torch.randn(n, dim, generator=g, requires_grad=True)
    teacher, weight = torch.randn(n, dim, generator=g), torch.randn(vocab, dim, generator=g)
    norm_w = (1 + 0.1 * torch.randn(dim, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[0, 5, 6]] = -100
    from longctx.ops.norm import rms_norm

    p = torch.softmax(teacher @ weight.T / t, -1)
    log_q = torch.log_softmax(rms_norm(h, norm_w, 1e-5) @ weight.T / t, -1)
    want = -(p * log_q).sum(-1)[labels != -100].sum()
    grads_want = torch.autograd.grad(want, (h, norm_w))
    for chunk in (0, 4, 100):
        got = lm_head_distill_loss(h, weight, teacher, labels, temperature=t, chunk=chunk, norm=(norm_w, 1e-5))
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-6)
        for a, b in zip(torch.autograd.grad(got, (h, norm_w)), grads_want):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# training


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short documents (20-300 bytes): every 128-token sample packs several."""
    return word_documents(tmp_path_factory.mktemp("glide-docs"), 300, 50)


def word_documents(d, count: int, longest: int) -> list[str]:
    """`count` documents of 3..`longest` keywords in `d` (seeded): the flags of a byte-tokenized corpus of them."""
    rng = random.Random(0)
    words = "def return self import class yield lambda async await with try except finally".split()
    for i in range(count):
        (d / f"doc{i:04d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(3, longest))) + "\n")
    return [f"--data.corpus={d}", "--data.tokenizer=byte"]


@pytest.fixture(scope="module")
def target(tmp_path_factory, corpus):
    """A tiny target trained 15 steps and saved through the normal checkpoint path: its checkpoints dir."""
    run = tmp_path_factory.mktemp("glide-target")
    cfg = load_config(None, [*QUIET, *corpus, "--model.layers=3", "--model.dim=64", "--model.ffn_dim=128",
                             "--train.steps=15", "--checkpoint.interval=15", f"--train.run_dir={run}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return run / "checkpoints"


def _draft_run(corpus, target, run_dir, *extra):
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={target}", f"--train.run_dir={run_dir}", *extra])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    return trainer, trainer.run()


def _target_model(target):
    from longctx.config.checkpoint_paths import latest_checkpoint

    path = latest_checkpoint(target)
    cfg = load_config(overrides=[f"--model.init_from={path}"]).model
    model = build_model(cfg, device="meta")
    model.to_empty(device="cpu")
    load_model_weights(path, model)
    model.init_rope()
    return model.eval(), path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, target):
    run = tmp_path_factory.mktemp("glide-draft")
    trainer, result = _draft_run(corpus, target, run, "--train.steps=30", "--checkpoint.interval=30",
                                 "--draft.layers=2", "--draft.block=3")
    return trainer, result, run / "checkpoints"


def test_the_draft_learns_and_the_target_stays_frozen(trained, target):
    trainer, result, _ = trained
    losses = result.losses
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    model = trainer.model
    # only the draft is optimised (and counted): the target is no submodule
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in model.draft.parameters()}
    assert all(k.startswith("draft.") for k in model.state_dict())
    assert all(not p.requires_grad and p.grad is None for p in model.target.parameters())
    assert not model.head.embed.requires_grad and not model.head.lm_head_weight.requires_grad
    fresh, _ = _target_model(target)
    now = model.target.state_dict()
    for name, value in fresh.state_dict().items():
        assert torch.equal(now[name], value), name


def test_throughput_counts_the_draft_steps_flops_not_the_targets_training(trained):
    import json

    from longctx.models.flops import draft_train_flops_per_token

    trainer, _, checkpoints = trained
    records = [json.loads(line) for line in (checkpoints.parent / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train
    cfg = trainer.cfg
    expected = draft_train_flops_per_token(cfg.model, cfg.train.seq_len, kind="glide", layers=2, block=3)
    for r in train:
        assert r["tflops"] * 1e12 / r["tokens_per_s"] == pytest.approx(expected, rel=1e-9)


def test_the_checkpoint_names_its_target_and_loads_for_generation(trained, target):
    from longctx.generate.local import prefill
    from longctx.models.glide import block_stale_visible
    from longctx.models.kv_cache import KVCache

    trainer, _, checkpoints = trained
    model, target_path = _target_model(target)
    record = glide_manifest(checkpoints)
    assert record["target"]["path"] == str(target_path.resolve())
    assert record["target"]["model"]["layers"] == 3 and record["layers"] == 2 and record["block"] == 3
    assert record["loss"] == "ce" and record["tokenizer"] == "byte"
    assert glide_manifest(target) is None and glide_manifest(checkpoints.parent) is None
    draft = load_glide_draft(checkpoints, model, "cpu")
    assert draft.block == 3 and draft.target_layers == [1, 2]
    # decoding's default draft window: the length it trained on (recorded), 0 or N when asked
    from longctx.generate.drafters import drafter_for

    assert draft.trained_seq_len == record["seq_len"] == trainer.cfg.train.seq_len
    assert drafter_for(model, draft, 200).window == trainer.cfg.train.seq_len
    assert drafter_for(model, draft, 200, window=0).window == 0
    tokens = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trainer.model(tokens)[0]
        cache = KVCache.for_model(model, 1, tokens.shape[1])
        prefill(model, cache, tokens, 64)
        kv = [(cache.k[i], cache.v[i]) for i in draft.target_layers]
        got = draft(model, tokens, torch.arange(50)[None], kv, block_stale_visible(50, 3)[None])[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    # a draft for another target, or a checkpoint that is no draft's
    other = build_model(load_config(overrides=["--model.layers=3", "--model.dim=64", "--model.ffn_dim=256"]).model)
    with pytest.raises(ConfigError, match="ffn_dim"):
        load_glide_draft(checkpoints, other)
    with pytest.raises(ConfigError, match="not a GliDe draft"):
        load_glide_draft(target, model)


def test_memory_policies_train_alike_and_a_resume_continues(tmp_path, corpus, target):
    steps = ["--train.steps=4", "--draft.loss=kd"]
    _, plain = _draft_run(corpus, target, tmp_path / "none", *steps)
    _, selective = _draft_run(corpus, target, tmp_path / "sel", *steps, "--memory.recompute=selective",
                              "--checkpoint.interval=2", "--memory.loss_chunk=100",
                              "--memory.attention_chunk=32")
    assert max(abs(a - b) for a, b in zip(plain.losses, selective.losses)) < 1e-5
    _, resumed = _draft_run(corpus, target, tmp_path / "sel", *steps, "--memory.recompute=full",
                            "--checkpoint.interval=2",
                            f"--checkpoint.resume={tmp_path / 'sel' / 'checkpoints' / 'step-00000002'}")
    assert resumed.first_step == 3 and len(resumed.losses) == 2
    assert max(abs(a - b) for a, b in zip(resumed.losses, plain.losses[2:])) < 1e-5


def test_the_recipe_config_loads(target):
    cfg = load_config("configs/glide.toml", [f"--draft.target={target}"])
    assert cfg.model.init_from == str(target) and cfg.model.layers == 3 and cfg.data.tokenizer == "byte"
    assert cfg.draft.layers == 1


def test_bad_input_is_refused_before_work(tmp_path, target, trained):
    def refused(*args, match):
        with pytest.raises(ConfigError, match=match):
            load_config(None, list(args))

    refused(f"--draft.target={tmp_path / 'nowhere'}", match="holds no complete longctx checkpoint")
    refused(f"--draft.target={tmp_path}", match="holds no complete longctx checkpoint")
    refused(f"--draft.target={trained[2]}", match="itself a GliDe draft")
    refused("--draft.target=hf:" + str(tmp_path), match="no config.json")
    refused(f"--draft.target={target}", "--draft.loss=mse", match="ce, kd")
    refused(f"--draft.target={target}", "--draft.block=0", match="draft.block")
    refused("--draft.block=-1", match="draft.block")
    refused(f"--draft.target={target}", "--draft.layers=4", match="at most the target's layers")
    refused(f"--draft.target={target}", "--draft.kd_temperature=0", match="kd_temperature")
    refused(f"--draft.target={target}", "--memory.recompute=selective", "--memory.offload_fraction=0.5",
            match="offload_fraction")
    refused(f"--draft.target={target}", f"--model.init_from={tmp_path}", match="drop model.init_from")
    with pytest.raises(HFFormatError, match="GliDe draft"):  # a draft is no model to start from
        load_config(None, [f"--model.init_from={trained[2]}"])


def test_a_reduced_vocabulary_is_the_datas_most_frequent_and_saved(tmp_path, corpus, target):
    # draft.vocab = N: the ids are the N tokens the training split uses most (counted here from the
    # samples the loader reads), the loss sees only them, and the checkpoint brings them back
    import numpy as np

    from longctx.data.loader import PackedSamples
    from longctx.train.setup import store_path

    trainer, result = _draft_run(corpus, target, tmp_path / "v", "--train.steps=3", "--draft.loss=kd",
                                 "--draft.vocab=40", "--checkpoint.interval=3")
    assert all(math.isfinite(x) for x in result.losses)
    samples = PackedSamples(store_path(trainer.cfg, lambda *a, **k: None, None), "train", True)
    counts = np.zeros(trainer.cfg.model.vocab_size, dtype=np.int64)
    for i in range(len(samples)):
        np.add.at(counts, np.asarray(samples.sample(i)[0]), 1)
    want = sorted(np.argsort(-counts, kind="stable")[:40].tolist())
    ids = trainer.model.draft.vocab.ids
    assert ids.tolist() == want
    model, _ = _target_model(target)
    draft = load_glide_draft(tmp_path / "v" / "checkpoints", model, "cpu")
    assert torch.equal(draft.vocab.ids, ids)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = trainer.model(tokens)[0]
    assert torch.isneginf(logits[:, [t for t in range(logits.shape[-1]) if t not in set(want)]]).all()
    with pytest.raises(ConfigError, match="draft.vocab"):
        load_config(None, [f"--draft.target={target}", f"--draft.vocab={model.cfg.vocab_size}"])


def test_a_draft_initialised_from_the_target_starts_as_its_last_layer(tmp_path, corpus, target):
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={target}", f"--train.run_dir={tmp_path / 'i'}",
                             "--draft.init=target", "--draft.layers=2", "--train.steps=1"])
    model = Trainer(cfg, log=lambda *a, **k: None).model
    fresh, _ = _target_model(target)
    draft = model.draft
    assert draft.target_layers == [1, 2]
    for layer, i in zip(draft.layers, draft.target_layers):
        block = fresh.layers[i]
        pairs = [(layer.self_attention.wq.weight, block.attention.wq.weight),
                 (layer.self_attention.wo.weight, block.attention.wo.weight),
                 (layer.cross_q.weight, block.attention.wq.weight), (layer.cross_o.weight, block.attention.wo.weight),
                 (layer.feed_forward.w2.weight, block.feed_forward.w2.weight),
                 (layer.self_norm.weight, block.attention_norm.weight), (layer.ffn_norm.weight, block.ffn_norm.weight)]
        for mine, theirs in pairs:
            assert torch.equal(mine.detach(), theirs), i
    assert torch.equal(draft.norm.weight.detach(), fresh.norm.weight)
    random = Trainer(load_config(None, [*QUIET, *corpus, f"--draft.target={target}", "--train.steps=1",
                                        f"--train.run_dir={tmp_path / 'r'}"]), log=lambda *a, **k: None).model
    assert not torch.equal(random.draft.layers[0].cross_q.weight.detach(), fresh.layers[2].attention.wq.weight)
    with pytest.raises(ConfigError, match="random, target"):
        load_config(None, [f"--draft.target={target}", "--draft.init=copy"])
