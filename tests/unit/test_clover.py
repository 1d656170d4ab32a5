"""The Clover draft (models/clover.py), its decoding (generate/drafters.py CloverDrafter) and training
(train/glide.py CloverTraining):
- the training forward's per-position states equal a reference run round by round, step by step (the
  decode-style chain), on packed documents, each document's Augmenting Block run on its own;
- decoding reads what training computes: after the target's prefill the drafter's proposals' logits,
  in a first round and in a second after a verification, equal the training forward's there;
- speculative decoding with a Clover draft (chain, CaPE tree, adaptive K, a window shorter than the
  prompt, a reduced vocabulary) is plain greedy decoding token for token;
- its parameters: about a one-layer GliDe draft's (SmolLM2-135M's shapes, built on meta);
- a tiny `longctx train --draft.kind clover` learns, saves, loads with equal logits;
- bad input: ConfigErrors."""

import inspect

import pytest
import torch
from test_adaptive_speculation import SCHEDULE, Scripted

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.generate import contracts
from longctx.generate.cape import CapeTable
from longctx.generate.drafters import CloverDrafter, drafter_for
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.generate.speculative import speculative_generate
from longctx.models.clover import CloverDraft
from longctx.models.glide import GlideDraft
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _target(layers=2):
    return build_model(load_config(overrides=[f"--model.layers={layers}"]).model, seed=1).eval()


def _draft(target, seed=2, std=0.1, vocab=0):
    draft = CloverDraft(target.cfg, vocab=vocab).init_weights(seed=seed, std=std)
    draft.block = 4
    return draft.eval()


def _reference_states(draft, target, tokens, lengths, block):
    """Per document (alone, positions from 0), per round starting at a multiple of `block`: the
    regressive chain step by step from the augmented state before the round (zeros at the start),
    each step reading the memory of the positions before the round."""
    out, start = [], 0
    for n in lengths:
        doc = tokens[:, start:start + n]
        positions = torch.arange(n)[None]
        hidden = target(doc, positions, hidden=True)
        augmented = draft.augment(hidden, positions)
        mem_k, mem_v = draft.memory(augmented, positions)
        for b0 in range(0, n, block):
            state = augmented[:, b0 - 1:b0] if b0 else torch.zeros(1, 1, target.cfg.dim)
            for p in range(b0, min(b0 + block, n)):
                state = draft.step(state, target.tok_embeddings(doc[:, p:p + 1]), positions[:, p:p + 1],
                                   mem_k, mem_v, b0)
                out.append(state[0, 0])
        start += n
    return torch.stack(out)


def test_training_states_equal_the_chain_run_round_by_round():
    target = _target()
    draft = _draft(target)
    lengths, block = [9, 3, 14], 4
    tokens = torch.randint(0, target.cfg.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        hidden = target(tokens, positions, doc_ids, hidden=True)
        got = draft.chain_states(target, tokens, positions, hidden, block, doc_ids)[0]
        want = _reference_states(draft, target, tokens, lengths, block)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    # the chain matters: one pass (every position started from A[p - 1]) is another thing
    with torch.no_grad():
        one = draft.chain_states(target, tokens, positions, hidden, 1, doc_ids)[0]
    assert not torch.allclose(one, want, atol=1e-3)


def _training_logits(draft, target, sequence, block):
    tokens = torch.tensor([sequence])
    positions = torch.arange(len(sequence))[None]
    return draft(target, tokens, positions, target(tokens, hidden=True), block)[0]


def test_decoding_reads_what_training_computes():
    target = _target()
    draft = _draft(target)
    block, k = 4, 4
    prompt = torch.randint(0, target.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    soft = Sampling(temperature=1.0)  # (no generator: the most likely token, q its softmax)
    with torch.inference_mode():
        drafter = CloverDrafter(draft, target, 64, block)  # (before the prefill: its hook captures it)
        cache = KVCache.for_model(target, 1, 64)
        target(torch.tensor([prompt]), cache=cache)
        drafter.start(prompt, cache)
        pending = 7
        proposals, q = drafter.propose(pending, k, soft, None)
        want = torch.softmax(_training_logits(draft, target, [*prompt, pending, *proposals[:-1]], block), -1)
        assert torch.allclose(q, want[len(prompt):], atol=1e-5, rtol=0)
        # the target verifies [pending, d_1..d_k]; keep d_1..d_3 (the next round starts at a block's start)
        target(torch.tensor([[pending, *proposals]]), cache=cache)
        cache.truncate(len(prompt) + block)
        drafter.accepted(block - 1, k)
        verified = [*prompt, pending, *proposals[:block - 1]]
        second, q2 = drafter.propose(11, k, soft, None)
        want2 = torch.softmax(_training_logits(draft, target, [*verified, 11, *second[:-1]], block), -1)
        assert torch.allclose(q2, want2[len(verified):], atol=1e-5, rtol=0)
        # rewind: the state start(prompt) left, as bench decode's repeats use it
        drafter.rewind(prompt)
        again, q3 = drafter.propose(pending, k, soft, None)
        assert again == proposals and torch.allclose(q3, q, atol=1e-6, rtol=0)


def test_the_drafter_keeps_the_drafter_contract_and_unhooks_when_collected():
    for name in ("start", "propose", "accepted", "rewind"):
        want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(contracts.Drafter, name)).parameters
                .values()]
        assert [(p.name, p.kind, p.default) for p in inspect.signature(getattr(CloverDrafter, name)).parameters
                .values()] == want, name
    target = _target()
    drafter = drafter_for(target, _draft(target), 32)
    assert isinstance(drafter, CloverDrafter) and isinstance(drafter, contracts.Drafter)
    assert len(target.norm._forward_hooks) == 1
    del drafter
    assert len(target.norm._forward_hooks) == 0


def _echo(draft, dim):
    """A draft that proposes the pending token again (Aug and the decoder's outputs zeroed, the
    regressive connection passing the state: s = norm(A[b0 - 1]) = H[b0 - 1], whose head gives the
    pending token): kept wherever the target repeats itself, so rounds keep all, some or none."""
    with torch.no_grad():
        for m in (draft.aug.attention.wo, draft.aug.feed_forward.w2, draft.out, draft.feed_forward.w2):
            m.weight.zero_()
        draft.regressive.weight.zero_()
        draft.regressive.weight[:, dim:] = torch.eye(dim)
    return draft


class _Recording(CloverDrafter):
    """Records (the next pending position, the state the next round starts from) after each round."""

    def accepted(self, n, k, extra=None, nodes=None):
        super().accepted(n, k, extra, nodes)
        self.states = [*getattr(self, "states", []), (self.base, self.state[0, 0].clone())]


@pytest.mark.parametrize("vocab", [0, 200])
def test_speculative_decoding_with_a_clover_draft_is_plain_greedy(vocab):
    target = _target()
    draft = _echo(_draft(target, seed=5, std=0.05, vocab=vocab), target.cfg.dim)
    if vocab:  # (the tokens the target repeats below among them)
        perm = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
        draft.vocab.ids.copy_(torch.tensor(sorted([31, 71, *[t for t in perm if t not in (31, 71)][:vocab - 2]])))
    new, k = 20, 4
    tables = (None, CapeTable.parse("0.3:2,0.7:1,1:0"))
    long = torch.randint(0, target.cfg.vocab_size, (22,), generator=torch.Generator().manual_seed(9)).tolist()
    kept = []
    for prompt in ([268], [*long, *[31] * 8]):
        n = len(prompt)
        plain = generate(target, [prompt], max_new_tokens=new)[0].tokens
        text = torch.tensor([[*prompt, *plain]])
        with torch.no_grad():  # every round's starting state: the augmented state of the last verified position
            augmented = draft.augment(target(text, hidden=True), torch.arange(text.shape[1])[None])[0]
        # (adaptive "plain": test_adaptive_speculation's scripted K with plain steps, K = 0, between rounds)
        for cape, adaptive, window in [(c, a, w) for c in tables for a in (False, True, "plain") for w in (0, 8)]:
            drafter = _Recording(draft, target, n + new + 40, block=k, window=window)
            policy = Scripted(k, SCHEDULE) if adaptive == "plain" else adaptive
            spec = speculative_generate(target, drafter, prompt, max_new_tokens=new, k=k, cape=cape, adaptive=policy)
            assert spec.tokens == plain, (n, cape, adaptive, window)
            if not window:  # (a window changes what the Augmenting Block sees)
                for base, state in drafter.states:
                    if base <= text.shape[1]:
                        assert torch.allclose(state, augmented[base - 1], atol=1e-5, rtol=0), (cape, base)
            assert drafter.offset == (max(0, n - window) if window else 0)
            # (the draft's cache holds every verified position from the window on: the last round may run past
            # the limit, whose extra tokens the result drops)
            assert int(drafter.cache.lengths[0]) == drafter.base - drafter.offset >= n + len(plain) - 1 - \
                drafter.offset
            kept += spec.accepted
    assert 0 in kept and k in kept and any(0 < n < k for n in kept), kept


def test_the_parameters_are_about_a_one_layer_glide_drafts():
    # SmolLM2-135M's shapes (dim 576, 9 heads, 3 kv heads of 64, ffn 1536, vocab 49,152, 30 layers)
    cfg = load_config(overrides=["--model.dim=576", "--model.heads=9", "--model.kv_heads=3", "--model.head_dim=64",
                                 "--model.ffn_dim=1536", "--model.vocab_size=49152", "--model.layers=30"]).model
    with torch.device("meta"):
        glide = sum(p.numel() for p in GlideDraft(cfg, layers=1).parameters())
        clover = sum(p.numel() for p in CloverDraft(cfg).parameters())
    assert glide == 4_204_800 and clover == 4_428_288, (glide, clover)
    assert 1.0 < clover / glide < 1.10


# ------------------------------------------------------------------------------------------------
# training (the fixtures' pattern of tests/unit/test_glide_training.py: a tiny target trained and saved)

QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--train.seq_len=64",
         "--train.global_batch=2", "--train.warmup_steps=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from test_glide_training import word_documents

    return word_documents(tmp_path_factory.mktemp("clover-docs"), 200, 30)


@pytest.fixture(scope="module")
def target_run(tmp_path_factory, corpus):
    from longctx.train.trainer import Trainer

    run = tmp_path_factory.mktemp("clover-target")
    cfg = load_config(None, [*QUIET, *corpus, "--model.layers=2", "--model.dim=64", "--model.ffn_dim=128",
                             "--train.steps=6", "--checkpoint.interval=6", f"--train.run_dir={run}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return run / "checkpoints"


@pytest.fixture(scope="module")
def clover_run(tmp_path_factory, corpus, target_run):
    """A Clover draft trained 12 steps against the tiny target (ce, a reduced vocabulary of 60)."""
    from longctx.train.trainer import Trainer

    run = tmp_path_factory.mktemp("clover-draft")
    cfg = load_config(None, [*QUIET, *corpus, f"--draft.target={target_run}", "--draft.kind=clover",
                             "--draft.loss=ce", "--draft.vocab=60", "--train.lr=3e-3", "--train.steps=12",
                             "--checkpoint.interval=12", f"--train.run_dir={run}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    return trainer, trainer.run().losses, run / "checkpoints"


def _loaded_target(target_run):
    from longctx.checkpoint.weights_only import load_model_weights
    from longctx.config.checkpoint_paths import latest_checkpoint

    path = latest_checkpoint(target_run)
    model = build_model(load_config(overrides=[f"--model.init_from={path}"]).model, device="meta")
    model.to_empty(device="cpu")
    load_model_weights(path, model)
    model.init_rope()
    return model.eval(), path


def test_a_clover_draft_trains_saves_and_loads(clover_run, target_run):
    from longctx.checkpoint.glide import glide_manifest, load_glide_draft
    from longctx.generate.drafts import draft_label
    from longctx.generate.spec_length import draft_cost_ratio
    from longctx.models.flops import forward_matmul_flops_per_token
    from longctx.train.glide import CloverTraining

    trainer, losses, checkpoints = clover_run
    assert isinstance(trainer.model, CloverTraining) and len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in trainer.model.draft.parameters()}
    record = glide_manifest(checkpoints)
    assert record["kind"] == "clover" and record["block"] == 4 and record["vocab"] == 60
    assert draft_label(record) == "a Clover draft (block 4)"
    model, _ = _loaded_target(target_run)
    draft = load_glide_draft(checkpoints, model, "cpu")
    assert isinstance(draft, CloverDraft) and draft.block == 4 and draft.trained_seq_len == 64
    assert torch.equal(draft.vocab.ids, trainer.model.draft.vocab.ids)
    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = trainer.model(tokens)[0]
        got = _training_logits(draft, model, tokens[0].tolist(), 4)
    seen = torch.isfinite(want)
    assert torch.equal(seen, torch.isfinite(got)) and torch.allclose(got[seen], want[seen], atol=1e-5, rtol=0)
    # adaptive K's cost: one step's weights and the 60 head rows, over the target's FLOPs per token
    step = sum(p.numel() for m in (draft.regressive, draft.query, draft.out, draft.feed_forward)
               for p in m.parameters())
    assert draft_cost_ratio(model, draft) == pytest.approx((2 * step + 2 * 64 * 60) /
                                                           forward_matmul_flops_per_token(model.cfg))


def test_a_clover_draft_is_refused_beside_another_target_sharded_or_compiled(tmp_path, corpus, clover_run,
                                                                             target_run):
    from longctx.checkpoint.glide import load_glide_draft
    from longctx.generate.drafts import draft_config
    from longctx.train.trainer import Trainer

    checkpoints = str(clover_run[2])
    model, path = _loaded_target(target_run)
    # another target of the same shape: refused by its identity, before any weight is read
    other = tmp_path / "other"
    Trainer(load_config(None, [*QUIET, *corpus, "--model.layers=2", "--model.dim=64", "--model.ffn_dim=128",
                               "--train.steps=1", "--checkpoint.interval=1", "--train.seed=5",
                               f"--train.run_dir={other}"]), log=lambda *a, **k: None).run()
    target_cfg = load_config(overrides=[f"--model.init_from={path}"])
    with pytest.raises(ConfigError, match="other weights"):
        draft_config(checkpoints, str(other / "checkpoints"), 4, target_cfg, "byte")
    wide = build_model(load_config(overrides=["--model.layers=2", "--model.dim=64", "--model.ffn_dim=256"]).model)
    with pytest.raises(ConfigError, match="ffn_dim"):
        load_glide_draft(checkpoints, wide)
    # decoding it: one device, eager
    sharded = load_config(overrides=[f"--model.init_from={path}", "--parallel.ctx=2"])
    with pytest.raises(ConfigError, match="--nproc 1"):
        draft_config(checkpoints, str(target_run), 4, sharded, "byte")
    with pytest.raises(ConfigError, match="--compile"):
        draft_config(checkpoints, str(target_run), 4, target_cfg, "byte", compile=True)
    with pytest.raises(ConfigError, match="--compile"):
        drafter_for(model, load_glide_draft(checkpoints, model), 64, compile=True)


def test_bad_clover_configs_are_refused_before_work(target_run):
    def refused(*args, match):
        with pytest.raises(ConfigError, match=match):
            load_config(None, list(args))

    refused("--draft.kind=clover", "--draft.layers=2", match="draft.layers = 2 is a GliDe-only option")
    refused("--draft.kind=clover", "--draft.init=target", match="GliDe-only")
    refused(f"--draft.target={target_run}", "--draft.kind=clover", "--parallel.ctx=2", match="--nproc 1")
    refused(f"--draft.target={target_run}", "--draft.kind=clover", "--memory.recompute=full", match="recompute")
    refused(f"--draft.target={target_run}", "--draft.kind=clover", "--memory.model_states=host",
            match="model_states")
    refused("--draft.kind=eagle", match="glide, clover")
    # (a kind without draft.target would train the model itself: refused, config/inert_options.py)
    refused("--draft.kind=clover", match="draft.target is ''")
    assert load_config(None, ["--draft.kind=clover", f"--draft.target={target_run}"]).draft.kind == "clover"
    # the recipe (its target's shapes come from draft.target: here the tiny one)
    recipe = load_config("configs/clover-smollm2.toml", [f"--draft.target={target_run}", "--data.tokenizer=byte",
                                                         "--draft.vocab=100"])
    assert (recipe.draft.kind, recipe.draft.block, recipe.draft.loss) == ("clover", 4, "kd")
    assert recipe.train.seq_len == 2048
