"""Mixture-of-Experts Hugging Face families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against
transformers on random tiny checkpoints that transformers itself writes, in both expert layouts:
one tensor per expert and projection (transformers 4's names, what save_pretrained still writes by
default) and transformers 5's fused 3D tensors. fp32 logits within 1e-4 on load and after our
export reloads in transformers; dense layers mixed in, shared experts, top-1 and top-2 routing under
both top-k normalisations (Mixtral always renormalises: at top-1 every weight is 1); and the errors
for what we cannot read or that contradicts the weights."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from longctx.config import load_config, to_dict  # noqa: E402
from longctx.config.hf import HFFormatError  # noqa: E402
from longctx.models.hf import config_from_hf, load_hf, save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402
from longctx.models.moe import MoEFeedForward  # noqa: E402

TOL = 1e-4
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "olmoe": "OlmoeForCausalLM"}
COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
              max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu", torch_dtype="float32",
              initializer_range=0.1, num_experts_per_tok=2)  # a large init: logits of order 1 make 1e-4 strict
# name -> (config.json, the MoE layers it means); each family, dense layers by both Qwen rules, shared
# experts, norm_topk_prob true and false, GQA, explicit head_dim, the optional attention biases
CASES = {
    "mixtral": (dict(model_type="mixtral", num_local_experts=8, intermediate_size=48, sliding_window=None,
                     rope_theta=1e6), (0, 1, 2)),
    "qwen2_moe-mlp_only": (dict(model_type="qwen2_moe", num_experts=6, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, intermediate_size=80, mlp_only_layers=[1],
                                norm_topk_prob=False, use_sliding_window=False), (0, 2)),
    "qwen2_moe-sparse_step": (dict(model_type="qwen2_moe", num_hidden_layers=4, num_experts=4, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=40, intermediate_size=96, decoder_sparse_step=2,
                                   mlp_only_layers=[3], norm_topk_prob=True, qkv_bias=False), (1,)),
    "qwen3_moe": (dict(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=32, intermediate_size=80,
                       head_dim=32, attention_bias=True, norm_topk_prob=True, mlp_only_layers=[0]), (1, 2)),
    "olmoe": (dict(model_type="olmoe", num_experts=4, intermediate_size=48, norm_topk_prob=False,
                   attention_bias=True, num_key_value_heads=4), (0, 1, 2)),
}
# every family under the other norm_topk_prob too (Mixtral has no such setting)
CASES.update({f"{case}-norm_topk_{not config['norm_topk_prob']}".lower(): (
    {**config, "norm_topk_prob": not config["norm_topk_prob"]}, sparse)
    for case, (config, sparse) in list(CASES.items()) if case in ("qwen3_moe", "olmoe")})
LAYOUTS = ("per_expert", "fused")


def hf_config(case: str, **extra) -> dict:
    config, _ = CASES[case]
    family = config["model_type"]
    return {**COMMON, "architectures": [ARCH[family]], **config, **extra}


@torch.no_grad()
def randomise(model):
    """`model` (a transformers MoE model) with random norms and biases (HF initialises them to 1 and 0, where a
    wrong mapping would not show) and routers of some conviction (top-k choices far from ties)."""
    for n, p in model.named_parameters():
        if "norm" in n:
            p.uniform_(0.5, 1.5)
        elif n.endswith(".bias"):
            p.normal_(0, 0.1)
        elif n.endswith("mlp.gate.weight"):
            p.normal_(0, 0.3)
    return model


def random_hf_dir(tmp_path, config: dict, layout: str = "per_expert", name: str = "hf", shard: str | None = None):
    """A random checkpoint written by transformers' save_pretrained: per expert (its default,
    save_original_format: transformers 4's names) or fused (transformers 5's 3D tensors)."""
    cfg = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(3)
    model = randomise(transformers.AutoModelForCausalLM.from_config(cfg).float().eval())
    d = tmp_path / name
    sizes = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d, save_original_format=layout == "per_expert", **sizes)
    return d, model


def stored_names(d) -> list[str]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    with safe_open(d / "model.safetensors", framework="pt") as f:
        return sorted(f.keys())


def tokens(vocab=300, seq=160):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(5))


def max_err(ours, theirs, t=None):
    t = tokens() if t is None else t
    with torch.no_grad():
        return (ours(t) - theirs(t).logits).abs().max().item()


# what each layout looks like in the file (layer 0's first expert), so the test knows it reads both
LAYOUT_NAMES = {
    ("mixtral", "per_expert"): "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    ("mixtral", "fused"): "model.layers.0.mlp.experts.gate_up_proj",
}


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_load_and_export_match_transformers(tmp_path, case, layout, top_k):
    """At top-1 a renormalised weight is 1 and an unnormalised one the probability p: a model that
    weighs by p where transformers weighs by 1 is off by O(1) in the logits."""
    config = hf_config(case, num_experts_per_tok=top_k)
    family, sparse = config["model_type"], CASES[case][1]
    d, ref = random_hf_dir(tmp_path, config, layout, shard="150KB" if case == "qwen3_moe" else None)
    names = stored_names(d)
    layer = sparse[0]
    expect = LAYOUT_NAMES.get((family, layout)) or (f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"
                                                     if layout == "per_expert" else
                                                     f"model.layers.{layer}.mlp.experts.gate_up_proj")
    assert expect.replace(".0.", f".{layer}.", 1) in names

    ours = load_hf(d)
    m = ours.cfg
    assert m.family == family and m.moe_layer_ids == sparse and m.moe_router == "softmax"
    assert m.moe_norm_topk == config.get("norm_topk_prob", True) and m.moe_top_k == top_k
    assert m.qk_norm == (family in ("qwen3_moe", "olmoe"))
    assert m.qk_norm_span == ("all" if family == "olmoe" else "head")
    assert bool(m.resolved_shared_dim) == (family == "qwen2_moe") == m.moe_shared_gate
    err = max_err(ours, ref)
    print(f"\n{case} {layout} top-{top_k}: load max |logits diff| = {err:.2e}")
    assert err <= TOL

    # export (per expert, or fused when the checkpoint was fused), reload in transformers, match again
    out = save_hf(ours, tmp_path / "export", max_shard_bytes=200_000, fused_experts=layout == "fused")
    written = stored_names(out)
    assert any((".experts.gate_up_proj" in n) == (layout == "fused") for n in written if ".experts." in n)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == ARCH[family]
    err = max_err(ours, theirs)
    print(f"{case} {layout} top-{top_k}: export max |logits diff| = {err:.2e}")
    assert json.loads((out / "config.json").read_text()).get("norm_topk_prob", True) == m.moe_norm_topk
    assert err <= TOL
    for (n, a), b in zip(ref.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), n  # the very weights transformers wrote
    back = load_hf(out)
    assert back.cfg == ours.cfg
    for (n, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n


def test_parity_check_can_fail(tmp_path):
    """The comparison sees a swapped gate/up, a router row out of place, the wrong top-k
    normalisation, a missing shared-expert gate and OLMoE's norm taken per head."""
    d, ref = random_hf_dir(tmp_path, hf_config("qwen2_moe-sparse_step"))
    assert max_err(load_hf(d), ref) <= TOL

    def broken(change):
        ours = load_hf(d)
        moe = next(m for m in ours.modules() if isinstance(m, MoEFeedForward))
        with torch.no_grad():
            change(moe)
        return max_err(ours, ref)

    def swap_gate_up(moe):
        w1 = moe.experts.w1.clone()
        moe.experts.w1.copy_(moe.experts.w3)
        moe.experts.w3.copy_(w1)

    def swap_router_rows(moe):
        moe.router.gate.weight.copy_(moe.router.gate.weight[[1, 0, *range(2, moe.num_experts)]])

    def flip_norm_topk(moe):
        moe.router.norm_topk = not moe.router.norm_topk

    def drop_shared_gate(moe):
        moe.shared_gate = None

    for change in (swap_gate_up, swap_router_rows, flip_norm_topk, drop_shared_gate):
        err = broken(change)
        assert err > 100 * TOL, (change.__name__, err)

    d2, ref2 = random_hf_dir(tmp_path, hf_config("olmoe"), name="olmoe")
    ours = load_hf(d2)
    assert max_err(ours, ref2) <= TOL
    for block in ours.layers:
        block.attention.qk_norm_all = False
        hd = block.attention.head_dim
        block.attention.q_norm.weight.data = block.attention.q_norm.weight.data[:hd]
        block.attention.k_norm.weight.data = block.attention.k_norm.weight.data[:hd]
    assert max_err(ours, ref2) > 100 * TOL


def _training_objective(ours, ids):
    """longctx's training objective on one micro-batch in one process, as Trainer.step forms it: the
    summed cross-entropy (forward_loss_sum) over the valid labels plus the router terms' loss. Every
    token is routed, the last one has no label: transformers' shift (labels=ids) exactly."""
    from longctx.data.samples import Batch
    from longctx.step.loss import forward_loss_sum

    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    ours.train()
    loss_sum = forward_loss_sum(ours, Batch(ids, labels, positions, None), None)
    terms = ours.router_terms()
    return loss_sum / (labels != -100).sum() + terms.loss


@pytest.mark.parametrize("router_logits", [True, False])
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_training_loss_is_transformers_loss(tmp_path, case, router_logits):
    """The loss longctx trains a loaded model on (cross-entropy + the router terms its config.json
    implies) equals transformers' model(ids, labels=ids, output_router_logits=...).loss, and so do
    the routers' gradients: with output_router_logits the pooled balancing loss at router_aux_loss_coef
    (3 MoE layers for Mixtral, 2 for Qwen3-MoE: pooled is not a per-layer mean), without it none."""
    config = hf_config(case, output_router_logits=router_logits, router_aux_loss_coef=0.3)
    d, ref = random_hf_dir(tmp_path, config)
    ours = load_hf(d)
    assert (ours.cfg.moe_aux_loss, ours.cfg.moe_aux_loss_scope) == ((0.3 if router_logits else 0.0), "pooled")
    from longctx.config.hf import init_from_notes

    (note,) = init_from_notes(f"hf:{d}")  # what the run's "weights: read from" line says about it
    assert ("output_router_logits=true, so its load-balancing loss, model.moe.aux_loss 0.3" in note if router_logits
            else "output_router_logits=false, so no load-balancing loss (model.moe.aux_loss 0" in note), note
    ids = tokens(seq=64)
    ref.train()
    out = ref(ids, labels=ids, output_router_logits=router_logits)
    loss = _training_objective(ours, ids)
    gates = [m.router.gate.weight for m in ours.modules() if isinstance(m, MoEFeedForward)]
    ref_gates = [p for n, p in ref.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(gates) == len(ref_gates) == len(CASES[case][1])
    diff = abs(loss.item() - out.loss.item())
    grad_diff = max((a - b).abs().max().item() for a, b in zip(torch.autograd.grad(loss, gates),
                                                                 torch.autograd.grad(out.loss, ref_gates)))
    aux = out.aux_loss.item() if router_logits else 0.0
    print(f"\n{case} output_router_logits={router_logits}: longctx {loss.item():.7f}, transformers "
          f"{out.loss.item():.7f} (aux {aux:.5f}), |diff| {diff:.1e}, router grads |diff| {grad_diff:.1e}")
    assert diff <= 1e-5 and grad_diff <= 1e-5
    if router_logits:
        assert 0.3 * aux > 100 * 1e-5  # the aux term weighs: leaving it out, or a per-layer mean, would show


def test_random_moe_models_export_to_transformers(tmp_path):
    """A MoE model trained from scratch (no init_from) exports as its family, per expert and fused."""
    shape = ["--model.dim=64", "--model.layers=3", "--model.heads=4", "--model.kv_heads=2", "--model.vocab_size=300",
             "--model.moe.experts=4", "--model.moe.top_k=2", "--model.moe.expert_dim=32"]
    for preset, extra in (("mixtral-8x7b", ["--model.ffn_dim=32", "--model.head_dim=16"]),
                          ("qwen3-30b-a3b", ["--model.ffn_dim=96", "--model.head_dim=32",
                                             "--model.moe.dense_layers=1"]),
                          ("olmoe-1b-7b", ["--model.ffn_dim=32", "--model.moe.norm_topk=true"]),
                          ("debug-moe", ["--model.family=qwen2_moe", "--model.moe.shared_dim=48",
                                         "--model.moe.shared_gate=true", "--model.qkv_bias=true",
                                         "--model.moe.dense_layers=0,2", "--model.moe.aux_loss_scope=pooled"])):
        cfg = load_config(overrides=[f"--model.preset={preset}", *shape, *extra]).model
        ours = build_model(cfg, seed=7)
        with torch.no_grad():
            for m in ours.modules():
                if isinstance(m, MoEFeedForward):
                    m.router.gate.weight.normal_(0, 0.3)
        for fused in (False, True):
            out = save_hf(ours, tmp_path / f"{preset}-{fused}", fused_experts=fused)
            theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            assert type(theirs).__name__ == ARCH[cfg.family]
            assert max_err(ours, theirs) <= TOL, (preset, fused)
            back = load_hf(out).cfg  # the same model (a shared expert reads back as one of shared_dim)
            assert back == dataclasses.replace(cfg, preset="hf", head_dim=cfg.resolved_head_dim,
                                               moe_shared_experts=back.moe_shared_experts)


def test_config_mapping_both_ways():
    """config.json -> [model] -> config.json keeps what transformers reads (expert counts under either
    name, Qwen's dense-layer rule, aux and z loss coefficients)."""
    from longctx.config.hf_export import hf_config_from_model

    losses = dict(router_aux_loss_coef=0.02, router_z_loss_coef=0.003)
    m = config_from_hf(hf_config("qwen2_moe-sparse_step", output_router_logits=True, **losses))
    assert (m.moe_experts, m.moe_top_k, m.moe_expert_dim, m.ffn_dim, m.resolved_shared_dim) == (4, 2, 32, 96, 40)
    assert m.moe_dense_layers == "0,2-3" and m.moe_layer_ids == (1,)
    assert (m.moe_aux_loss, m.moe_aux_loss_scope, m.moe_z_loss) == (0.02, "pooled", 0.003)
    assert (m.qkv_bias, m.out_bias) == (False, False)
    back = hf_config_from_model(m)
    assert back["mlp_only_layers"] == [0, 2, 3] and back["decoder_sparse_step"] == 1
    assert back["router_z_loss_coef"] == 0.003 and back["qkv_bias"] is False
    assert back["output_router_logits"] is True and back["router_aux_loss_coef"] == 0.02
    assert config_from_hf(back) == m
    # output_router_logits false (transformers' default): transformers trains without a balancing loss;
    # router_z_loss_coef (written only by longctx's export) is the z-loss either way
    off = config_from_hf(hf_config("qwen2_moe-sparse_step", **losses))
    assert (off.moe_aux_loss, off.moe_z_loss, off.moe_aux_loss_scope) == (0.0, 0.003, "pooled")
    assert hf_config_from_model(off)["output_router_logits"] is False
    assert config_from_hf(hf_config("qwen2_moe-sparse_step")).moe_z_loss == 0.0  # as transformers writes it
    # transformers 5 writes Qwen3-MoE's count as num_local_experts (its attribute_map), the Hub num_experts
    q3 = hf_config("qwen3_moe")
    q3["num_local_experts"] = q3.pop("num_experts")
    assert config_from_hf(q3).moe_experts == 8
    mix = config_from_hf(hf_config("mixtral", output_router_logits=True))
    assert (mix.moe_experts, mix.moe_expert_dim, mix.moe_norm_topk, mix.moe_aux_loss) == (8, 48, True, 0.001)
    # a balancing loss transformers cannot state (per layer): the weights export, the loss is left off and said
    from longctx.config.hf_export import export_notes

    for z in (0.0, 0.003):  # (a z-loss must not turn on transformers' pooled aux loss)
        per_layer = dataclasses.replace(m, moe_aux_loss_scope="per_layer_mean", moe_z_loss=z)
        written = hf_config_from_model(per_layer)
        assert written["output_router_logits"] is False and written["router_aux_loss_coef"] == 0.02
        notes = export_notes(per_layer)
        assert "aux_loss_scope=per_layer_mean" in notes[0] and "output_router_logits=false" in notes[0]
        assert len(notes) == 1 + bool(z)
        back = config_from_hf(written)  # read back: no balancing loss, the z-loss kept
        assert (back.moe_aux_loss, back.moe_z_loss) == (0.0, z)
    assert [n.split(" (")[0] for n in export_notes(m)] == ["the run's router z-loss"]
    assert export_notes(dataclasses.replace(m, moe_z_loss=0.0)) == []


def test_unsupported_features_are_refused():
    for case, bad, match in [
        ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0"),
        ("mixtral", dict(sliding_window=64), "sliding-window"),
        ("qwen2_moe-mlp_only", dict(use_sliding_window=True, sliding_window=64), "sliding-window"),
        ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step is 0"),
        ("qwen2_moe-mlp_only", dict(num_experts=0), "num_experts=0"),
        ("olmoe", dict(head_dim=32), "q/k norms span hidden_size"),
    ]:
        with pytest.raises(HFFormatError, match=match):
            config_from_hf(hf_config(case, **bad), "x/config.json")


def test_export_refuses_what_the_family_cannot_express(tmp_path):
    base = ["--model.preset=debug-moe", "--model.layers=2", "--model.dim=64", "--model.heads=4", "--model.kv_heads=2"]
    for extra, match in [
        (["--model.family=mixtral", "--model.ffn_dim=128"], "mixtral has experts in every layer"),
        (["--model.family=mixtral", "--model.moe.dense_layers=", "--model.ffn_dim=128",
          "--model.moe.router=sinkhorn"], "router=sinkhorn"),
        (["--model.family=qwen3_moe", "--model.qk_norm=true", "--model.moe.shared_dim=32"], "no shared experts"),
        (["--model.family=qwen2_moe", "--model.qkv_bias=true", "--model.moe.shared_dim=32"],
         "gates its shared expert"),
        ([], "exports as one of mixtral"),  # family llama with experts
    ]:
        model = build_model(load_config(overrides=[*base, *extra]).model)
        with pytest.raises(HFFormatError, match=match):
            save_hf(model, tmp_path / "x")
        assert not (tmp_path / "x").exists()  # refused before anything is written
    # (a per-layer balancing loss is a training objective, not the weights: exported, and said)
    cfg = load_config(overrides=[*base, "--model.family=qwen3_moe", "--model.qk_norm=true",
                                 "--model.moe.aux_loss_scope=per_layer_sum"]).model
    model = build_model(cfg)
    save_hf(model, tmp_path / "ok")
    next(m for m in model.modules() if isinstance(m, MoEFeedForward)).router.expert_bias[0] = 0.5
    with pytest.raises(HFFormatError, match="expert_bias is not zero"):
        save_hf(model, tmp_path / "biased")


def test_a_qwen2_moe_without_shared_experts_exports_to_what_transformers_computes(tmp_path):
    """shared_expert_intermediate_size 0: transformers builds a 0-wide shared expert behind a gate, which adds
    nothing; longctx reads it as no shared expert, and its export (refused before, with advice the import
    itself rejected) writes that 0-wide expert, so transformers loads every weight it builds and computes
    the model's logits."""
    config = hf_config("qwen2_moe-mlp_only", shared_expert_intermediate_size=0)
    d, ref = random_hf_dir(tmp_path, config)
    ours = load_hf(d)
    assert ours.cfg.resolved_shared_dim == 0 and not ours.cfg.moe_shared_gate
    assert max_err(ours, ref) <= TOL
    out = save_hf(ours, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["shared_expert_intermediate_size"] == 0
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    err = max_err(ours, theirs.eval())
    print(f"\nqwen2_moe without shared experts: export max |logits diff| = {err:.2e}")
    assert err <= TOL
    assert load_hf(out).cfg == ours.cfg


def test_expert_count_contradicting_the_weights_is_one_clear_error(tmp_path):
    """--model.moe.experts against a checkpoint with another count: refused while the config is read
    (an HF directory, a longctx checkpoint, and from the command line before any rank starts); and
    weights whose expert count disagrees with their own config.json, named."""
    d, _ = random_hf_dir(tmp_path, hf_config("mixtral"))
    with pytest.raises(HFFormatError, match=r"model.moe.experts=4 contradicts the weights .* "
                                            r"config.json has num_local_experts=8, so model.moe.experts must be 8"):
        load_config(overrides=[f"--model.init_from=hf:{d}", "--model.moe.experts=4"])
    with pytest.raises(HFFormatError, match="model.moe.top_k=1 contradicts .* num_experts_per_tok=2"):
        load_config(overrides=[f"--model.init_from=hf:{d}", "--model.moe.top_k=1"])
    with pytest.raises(HFFormatError, match="model.moe.experts=4 contradicts .* model_type='llama'"):
        dense = tmp_path / "dense"
        dense.mkdir()
        (dense / "config.json").write_text(json.dumps(dict(
            model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=300)))
        load_config(overrides=[f"--model.init_from=hf:{dense}", "--model.moe.experts=4"])
    # training knobs are the run's own: they apply on top of the checkpoint's
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}", "--model.moe.aux_loss=0.05",
                                 "--model.moe.capacity_factor=1.25", "--train.seq_len=128"]).model
    assert (cfg.moe_aux_loss, cfg.moe_capacity_factor, cfg.moe_experts) == (0.05, 1.25, 8)

    # a longctx checkpoint: its manifest's [model] decides
    step = tmp_path / "ckpt" / "step-00000010"
    step.mkdir(parents=True)
    model = to_dict(load_config(overrides=["--model.preset=debug-moe"]))["model"]
    (step / "manifest.json").write_text(json.dumps({"model": model}))
    with pytest.raises(HFFormatError, match=r"model.moe.experts=4 contradicts .* its manifest has "
                                            r"model.moe.experts=8"):
        load_config(overrides=[f"--model.init_from={step.parent}", "--model.moe.experts=4"])

    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--nproc=2", f"--model.init_from=hf:{d}",
                        "--model.moe.experts=4", "--train.seq_len=128", "--train.steps=1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("model.moe.experts=4 contradicts") == 1 and "rank" not in r.stderr

    # the weights themselves against their config.json: fused and per-expert, fewer and more experts
    for layout in LAYOUTS:
        d2, _ = random_hf_dir(tmp_path, hf_config("qwen3_moe"), layout, name=f"lie-{layout}")
        config = json.loads((d2 / "config.json").read_text())
        key = "num_local_experts" if "num_local_experts" in config else "num_experts"
        for count, match in ((16, r"mlp.gate.weight has shape \(8, 64\), config.json implies \(16, 64\)"
                               if layout == "fused" else "lacks 48 tensors .* model.layers.1.mlp.experts.8"),
                             (4, r"mlp.gate.weight has shape \(8, 64\)" if layout == "fused" else
                              "model.layers.1.mlp.experts.4.gate_proj.weight: more experts than config.json's 4")):
            (d2 / "config.json").write_text(json.dumps({**config, key: count}))
            with pytest.raises(HFFormatError, match=match):
                load_hf(d2)


def test_plan_resolves_a_moe_checkpoint(tmp_path):
    import argparse

    from longctx.planner.cli import add_arguments, build_request

    d, _ = random_hf_dir(tmp_path, hf_config("qwen2_moe-mlp_only", max_position_embeddings=8192))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    req, base = build_request(parser.parse_args(["--model", f"hf:{d}", "--gpus", "8", "--seq-len", "4K"]), [])
    m = base.model
    assert (m.family, m.moe_experts, m.moe_layer_ids, m.resolved_shared_dim) == ("qwen2_moe", 6, (0, 2), 48)
    assert req.model == m


def test_a_mixtral_with_router_jitter_reads_as_transformers_infers_and_training_says_it(tmp_path):
    """router_jitter_noise > 0 (some fine-tunes' config.json): transformers multiplies the router's input by
    noise in training only, so eval and generate must read the model (they were refused when the config was
    read); its logits equal transformers' eval-mode ones, and a run training from it says the jitter is not
    applied (as dropout is said)."""
    from longctx.config.hf import init_from_notes

    d, ref = random_hf_dir(tmp_path, hf_config("mixtral", router_jitter_noise=0.1))
    ours = load_hf(d)
    assert max_err(ours, ref.eval()) < 1e-4
    notes = init_from_notes(f"hf:{d}")
    assert any("router_jitter_noise=0.1: longctx's router trains without it" in n for n in notes), notes
    plain, _ = random_hf_dir(tmp_path, hf_config("mixtral"), name="plain")
    assert not any("jitter" in n for n in init_from_notes(f"hf:{plain}"))
