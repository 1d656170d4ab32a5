"""Review of session 73's changes: co2's re-clip of the synchronous (expert) weights, MoE generation's
`dropless`, the q/k dtype under Ms-PoE, a spawned rank's plainly pickled result, and the expert placer's
cost line under a memory policy that runs a block in pieces.

The references are hand computations in float64 (the clip coefficients), the model's configured
capacity (restored after generation, whatever happens in it), and the attention kernels' one dtype."""

import math

import pytest
import torch

from longctx.config import load_config
from longctx.models.llama import build_model
from longctx.models.moe import moe_layers

# ---- step/co2.py reclip_synchronous --------------------------------------------------------------


def _clipped(raw: list[torch.Tensor], norm: float, max_norm: float) -> list[torch.Tensor]:
    """clip_grads_with_norm_'s result, as clip_gradients leaves each replica's gradients."""
    coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0  # (train.grad_clip = 0: none)
    return [g * coef for g in raw]


def _params(raw: list[torch.Tensor], norm: float, max_norm: float) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in raw]
    for p, g in zip(params, _clipped(raw, norm, max_norm)):
        p.grad = g.clone()
    return params


@pytest.mark.parametrize("own, agreed", [(3.0, 5.0), (0.5, 2.0), (0.4, 0.8), (4.0, 4.0)])
def test_reclip_gives_the_agreed_norms_coefficient_whatever_the_own_one_was(own, agreed):
    """The expert weights' gradients end as the raw ones times min(1, clip / (agreed + 1e-6)) (float64 by hand),
    also where this replica's own norm was under the clip (its coefficient 1) and the agreed one over it."""
    from longctx.step.co2 import reclip_synchronous

    gen = torch.Generator().manual_seed(0)
    raw = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    max_norm = 1.0
    params = _params(raw, own, max_norm)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # a parameter without a gradient: skipped
    reclip_synchronous(params, torch.tensor(own), torch.tensor(agreed), max_norm)
    want = min(1.0, max_norm / (agreed + 1e-6))
    for p, g in zip(params, raw):
        assert torch.allclose(p.grad.double(), g.double() * want, rtol=1e-6, atol=0), (own, agreed)


def test_reclip_does_nothing_without_a_clip_or_gradients():
    from longctx.step.co2 import reclip_synchronous

    raw = [torch.randn(3, 3)]
    params = _params(raw, 5.0, 0.0)
    reclip_synchronous(params, torch.tensor(5.0), torch.tensor(9.0), 0.0)  # train.grad_clip = 0: no clipping
    assert torch.equal(params[0].grad, raw[0])
    reclip_synchronous([], torch.tensor(5.0), torch.tensor(9.0), 1.0)  # no expert weights
    reclip_synchronous([torch.nn.Parameter(torch.zeros(2))], torch.tensor(5.0), torch.tensor(9.0), 1.0)


@pytest.mark.parametrize("own, agreed", [(3.0, math.inf), (math.nan, math.inf), (math.inf, math.inf)])
def test_reclip_under_a_non_finite_norm_leaves_nothing_a_step_could_apply_silently(own, agreed):
    """A replica's non-finite norm reaches the guard as +inf (agreed_norm), which skips the step: the
    gradients are then zero or non-finite, never finite and scaled by a stale coefficient."""
    from longctx.step.co2 import reclip_synchronous

    raw = [torch.randn(3, 3)]
    params = _params(raw, 3.0 if math.isfinite(own) else 1.0, 1.0)
    reclip_synchronous(params, torch.tensor(own), torch.tensor(agreed), 1.0)
    g = params[0].grad
    assert bool((g == 0).all()) or not bool(torch.isfinite(g).all()), g


# ---- models/moe_eval_routing.py dropless ----------------------------------------------------------


def _capacity_model(capacity: float = 1.25):
    cfg = load_config(overrides=["--model.preset=debug-moe", f"--model.moe.capacity_factor={capacity}"]).model
    return build_model(cfg, seed=1).eval()


def test_dropless_nests_skips_none_and_dense_models_and_restores_after_an_error():
    from longctx.models.moe_eval_routing import dropless

    moe, dense = _capacity_model(), build_model(load_config().model, seed=1)
    layers = moe_layers(moe)
    assert layers and not moe_layers(dense)
    with pytest.raises(RuntimeError, match="inside"):
        with dropless(moe, None, dense):
            assert all(layer.capacity_factor == 0.0 for layer in layers)
            with dropless(moe, moe):  # nested, and the same model twice (a draft that is the target)
                assert all(layer.capacity_factor == 0.0 for layer in layers)
            assert all(layer.capacity_factor == 0.0 for layer in layers)
            raise RuntimeError("inside")
    assert all(layer.capacity_factor == 1.25 for layer in layers)


def test_generation_that_fails_midway_leaves_the_models_capacity():
    """decode's dropless is undone when a stop callback raises in the middle of generation."""
    from longctx.generate.engine import generate

    model = _capacity_model()

    def stop(row, tokens):
        raise KeyError("stop callback")

    with pytest.raises(KeyError):
        generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=4, stop=stop)
    assert all(layer.capacity_factor == 1.25 for layer in moe_layers(model))


# ---- models/llama.py: q and k in v's dtype, Ms-PoE's path too -------------------------------------


def test_ms_poe_qk_normed_attention_inputs_share_the_compute_dtype():
    """Ms-PoE's per-kv-head RoPE tables (eval and generate, where eval may run fp32 weights under bf16 autocast)
    with q/k RMSNorm (Qwen3): the core gets q, k and v in bf16 in every layer, Ms-PoE's and plain RoPE's."""
    cfg = load_config(overrides=["--model.family=qwen3", "--model.qk_norm=true", "--model.rope_ms_poe=true",
                                 "--model.rope_ms_poe_skip_layers=1"]).model
    model = build_model(cfg, seed=0).eval()
    model.init_rope()
    assert model.ms_poe_ratios is not None
    seen = []
    for block in model.layers:
        core = block.attention.core
        block.attention.core = lambda q, k, v, doc, core=core: (seen.append((q.dtype, k.dtype, v.dtype)),
                                                               core(q, k, v, doc))[1]
    t = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(t)
    assert len(seen) == cfg.layers and all(d == (torch.bfloat16,) * 3 for d in seen), seen


# ---- parallel/expert/placement.py: the cost line ----------------------------------------------------


def test_the_placers_cost_line_counts_a_memory_policys_pieces():
    """A MoE layer run in pieces (memory.block_chunk; offload_fraction's two parts) fetches its copies in each
    piece: 2 layers x 8 chunks of 16 tokens made 16 fetches per micro-batch on a 2-rank expert-parallel run (32
    with the selective recomputation), not the 2 a line "per micro-batch" states."""
    from longctx.parallel.expert.placement import ExpertPlacer

    layers = moe_layers(_capacity_model())
    placer = ExpertPlacer(layers, ep=2, replicas=1, window=1)
    counts = torch.full((len(layers), layers[0].num_experts), 2.0)
    counts[:, 0] = 40.0  # one hot expert on rank 0: a copy pays
    line = placer.observe(counts)
    assert line is not None and "copies" in line
    assert "per micro-batch (times the pieces a memory policy runs it in" in line, line


# ---- job/spawn.py: results pickled by the rank ------------------------------------------------------


def _non_leaf():
    x = torch.arange(3.0, requires_grad=True)
    return {"y": x * 2}


def test_a_non_leaf_tensor_that_requires_grad_comes_back_by_value():
    """The queue's pickler refused it ("Cowardly refusing to serialize non-leaf tensor"), in the queue's feeder
    thread, so the result was lost; plain pickle sends its values."""
    from longctx.job.spawn import run_spawned

    got = run_spawned(1, _non_leaf)[0]["y"]
    assert torch.equal(got.detach(), torch.tensor([0.0, 2.0, 4.0]))


def test_a_train_mode_draft_proposes_in_eval_mode_and_gets_its_mode_back():
    """speculative_generate runs the draft as decode runs the target: eval mode (a train-mode Sinkhorn router
    would propose by its balanced assignment), dropless, and as it was after."""
    from longctx.generate.drafters import ModelDrafter
    from longctx.generate.speculative import speculative_generate

    target, draft = _capacity_model(), _capacity_model().train()
    seen = []
    draft.register_forward_pre_hook(lambda module, args: seen.append(
        (module.training, [layer.capacity_factor for layer in moe_layers(module)])))
    speculative_generate(target, ModelDrafter(draft, max_len=64), [1, 2, 3, 4, 5], max_new_tokens=6, k=2)
    assert seen and all(not training and set(caps) == {0.0} for training, caps in seen), seen[:3]
    assert draft.training and all(layer.capacity_factor == 1.25 for layer in moe_layers(draft))


def test_generate_says_once_that_a_capacity_target_or_draft_runs_dropless():
    from longctx.generate.loading import dropless_notes as _dropless_notes

    capacity = load_config(overrides=["--model.preset=debug-moe", "--model.moe.capacity_factor=1.25"]).model
    assert _dropless_notes("draft", capacity) == [
        "the draft generates dropless: its moe.capacity_factor 1.25 is left out, since a capacity is shared by the "
        "tokens of a call and would make a prompt's tokens depend on the prompts batched with it and on how its "
        "prefill is chunked"]
    assert _dropless_notes("model", load_config(overrides=["--model.preset=debug-moe"]).model) == []
    assert _dropless_notes("draft", None) == []  # a GliDe draft's record: no MoE
