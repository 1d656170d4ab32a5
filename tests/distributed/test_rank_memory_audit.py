"""Rank-memory audit: building a GliDe draft's training model (train/glide.py build_glide_training) under
FSDP over 2 ranks never holds the whole draft on a rank. The draft was built whole on every rank (its
values drawn, or copied from the target, in full) and only then sharded: a transient the size of the
model the run trains, on every rank, where the target (and any other model, train/model.py) is built on
the meta device, sharded, and each rank fills only its shards.

Measured by the profiler's allocator events (every CPU allocation, those inside DTensor and FSDP calls
too) from the moment the frozen target is built to the end of the build: the most bytes allocated and not
yet freed, against the bytes of the whole draft (its parameters' global shapes, fp32). Sharded over 2
ranks a rank holds half of it plus a parameter's transients; before, at least all of it. The values are
checked too: each draft weight, gathered, is what one process draws from train.seed (draft.init random),
or the target layer's weight it copies (draft.init target)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from longctx.job.spawn import run_spawned_many  # noqa: E402

# (8 GliDe layers of ~33K parameters each, the largest 4K: the whole draft is ~64 of its largest parameter)
TARGET = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=320, max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="float32")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("glide-target")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TARGET)).save_pretrained(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return d


def _build(target: str, init: str) -> dict:
    """On each rank: the build's peak bytes after the target (profiler allocator events), the whole draft's
    bytes, and how far its gathered weights are from the reference values."""
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile

    from longctx.config import load_config
    from longctx.job.join import join_job
    from longctx.models.glide import GlideDraft
    from longctx.train import glide

    cfg = load_config(None, [f"--draft.target=hf:{target}", "--draft.layers=8", f"--draft.init={init}",
                             "--data.tokenizer=byte", "--train.seq_len=64", "--train.global_batch=2"])
    rt, device = join_job(cfg, training=True)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    frozen_target = glide.frozen_target

    def target_then_profile(*args, **kwargs):  # the draft's part of the build only
        out = frozen_target(*args, **kwargs)
        prof.start()
        return out

    glide.frozen_target = target_then_profile
    try:
        model = glide.build_glide_training(cfg, device, rt, log=lambda *a, **k: None)
    finally:
        glide.frozen_target = frozen_target
    prof.stop()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731
    if init == "random":  # the reference: the draft one process builds from the seed
        ref = dict(GlideDraft(cfg.model, 8).init_weights(cfg.train.seed).named_parameters())
    else:  # draft layer i starts as the target layer it reads (its attention's q and o for the cross-attention)
        t = dict((n, full(p)) for n, p in model.target.named_parameters())
        ref = {}
        for name, _ in model.draft.named_parameters():
            if not name.startswith("layers."):
                ref[name] = t["norm.weight"]
                continue
            _, i, rest = name.split(".", 2)
            layer = f"layers.{model.draft.target_layers[int(i)]}"
            for ours, theirs in (("self_norm", "attention_norm"), ("cross_norm", "attention_norm"),
                                 ("self_attention", "attention"), ("cross_q", "attention.wq"),
                                 ("cross_o", "attention.wo"), ("ffn_norm", "ffn_norm"),
                                 ("feed_forward", "feed_forward")):
                if rest.startswith(ours + "."):
                    ref[name] = t[f"{layer}.{theirs}{rest[len(ours):]}"]
    params = dict(model.draft.named_parameters())
    error = max(float((full(p).detach().cpu() - ref[n].detach().cpu()).abs().max()) for n, p in params.items())
    return {"peak": peak, "draft": sum(p.numel() * 4 for p in params.values()),
            "largest": max(p.numel() * 4 for p in params.values()), "error": error}


@pytest.fixture(scope="module")
def built(target_dir):
    """Both draft.init values, in one spawned job of 2 ranks: {init: [each rank's _build]}."""
    return run_spawned_many(2, [(init, _build, (str(target_dir), init)) for init in ("random", "target")])


@pytest.mark.parametrize("init", ["random", "target"])
def test_glide_draft_build_holds_half_the_draft_on_each_of_two_ranks(built, init):
    for result in built[init]:
        # its half of the draft (0.50) + one parameter's transients (0.02 each) + the target layers' gathers
        # and FSDP's padding: 0.56-0.67 measured; a whole draft on the rank is >= 1 (1.1-1.2 measured before)
        assert result["peak"] < 0.8 * result["draft"], result
        assert result["error"] == 0.0, result
