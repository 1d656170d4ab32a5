"""A seeded randomized audit of the Mixture-of-Experts Hugging Face families (mixtral, qwen2_moe, qwen3_moe, olmoe)
against transformers, through training: 32 tiny configs (tests/hfmoe_fuzz120_reference.py) over expert counts,
top-k from 1 to every expert, norm_topk_prob, Qwen's decoder_sparse_step and mlp_only_layers, Qwen2-MoE's shared
expert (0 wide too), GQA, a head_dim that is not hidden / heads, attention biases, tied heads, RoPE bases and
scalings, rms_norm_eps, windows that never bind, output_router_logits with router_aux_loss_coef, and the
router_z_loss_coef longctx's export writes. transformers builds each with random weights and save_pretrained writes
it (per expert or fused, whole or in shards); longctx's load_hf must give transformers' fp32 logits, its training
objective (cross-entropy + the router terms config.json implies) transformers' model(ids, labels=ids).loss, and
the gradient of every parameter transformers'. The run's own path (model.init_from = hf:DIR, a checkpoint,
`longctx checkpoint export`) then writes it back, and transformers reads the export as the same model: the same
weights bit for bit, logits to rounding and the same training loss (so the router-loss keys came back too). Nine
draws (hfmoe_fuzz120_reference.REFUSED_CASES) carry what longctx does not compute (OLMoE's clip_qkv or a head_dim its
norms cannot hold, a window shorter than the tokens, a Qwen-MoE with no layer of experts, another activation, more
experts per token than the model has): load_hf and the run's config must both refuse it, naming it, before any
weight is read. The tokens avoid OLMoE's pad id (hfmoe_fuzz120_reference.tokens says why).
"""

import json
import random
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
import torch.distributed.checkpoint as dcp  # noqa: E402

import hfmoe_fuzz120_reference as R  # noqa: E402
from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import write_manifest  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.hf import HFFormatError  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402
from longctx.data.samples import Batch  # noqa: E402
from longctx.models.hf import load_hf, load_hf_weights  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402
from longctx.step.loss import forward_loss_sum  # noqa: E402

CASES = range(32)
# the everyday loop's share: each family, mlp_only_layers, a shared expert, a z-loss, a refusal by activation and
# OLMoE's clip_qkv (chosen so that each deliberate break the audit was tried with fails here too)
FAST = (0, 1, 2, 3, 5, 6, 9, 27)
LOGIT_TOL, LOSS_TOL, GRAD_TOL = 2e-5, 2e-6, 2e-6


def _objective(model, ids: torch.Tensor) -> torch.Tensor:
    """longctx's training objective on one micro-batch, as the trainer forms it: the summed cross-entropy over the
    valid labels (transformers' shift: the last token has none) over their count, plus the router terms."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    model.train()
    loss_sum = forward_loss_sum(model, Batch(ids, labels, torch.arange(ids.shape[1]).expand_as(ids), None), None)
    terms = model.router_terms()
    return loss_sum / (labels != -100).sum() + terms.loss


def _saved(tmp_path, index: int, config: dict):
    """The directory save_pretrained writes for case `index` (fused or per expert, shards or not), and transformers'
    model read back from it."""
    rng = random.Random(f"hfmoe120-save-{index}")
    d = tmp_path / "hf"
    if config.get("head_dim") and config["model_type"] == "olmoe" and \
            config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        d.mkdir()  # (transformers cannot build it: the refusal needs config.json alone)
        (d / "config.json").write_text(json.dumps(config))
        return d, None
    R.save(R.build(config, seed=index), d, fused=rng.random() < 0.4, shard=rng.choice([None, None, "40KB", "12KB"]))
    return d, R.read(d)


def _exported(tmp_path, d, shard_bytes: int):
    """`longctx checkpoint export` of a checkpoint of the run that starts from hf:`d`."""
    config = load_config(overrides=[f"--model.init_from=hf:{d}", f"--train.seq_len={R.SEQ}"])
    model = build_model(config.model, device="meta")
    model.to_empty(device="cpu")
    load_hf_weights(model, d)
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    with warnings.catch_warnings():  # (DCP's "assuming the intent is to save in a single process")
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_manifest(step, step=1, layout={}, model=to_dict(config)["model"])
    return export_hf(step, tmp_path / "export", max_shard_bytes=shard_bytes)[0]


def _check_refused(d, pattern: str) -> None:
    with pytest.raises(HFFormatError, match=pattern):
        load_hf(d)
    with pytest.raises(HFFormatError, match=pattern):
        load_config(overrides=[f"--model.init_from=hf:{d}", f"--train.seq_len={R.SEQ}"])


def _check_training(ours, ref, ids) -> float:
    """longctx's objective and every gradient against transformers'; the loss (for the export's check)."""
    want = R.reference_loss(ref, ids)
    params = [(n, p) for n, p in ours.named_parameters() if not n.endswith("router.expert_bias")]
    got = _objective(ours, ids)
    assert abs(got.item() - want.item()) <= LOSS_TOL * max(1.0, abs(want.item())), (got.item(), want.item())
    expected = R.grads_by_our_name(ref, want, params)
    for (name, _), grad in zip(params, torch.autograd.grad(got, [p for _, p in params])):
        theirs = expected[name]
        assert theirs is not None and grad.shape == theirs.shape, name
        err = (grad - theirs).abs().max().item() if grad.numel() else 0.0
        assert err <= GRAD_TOL * max(1.0, theirs.abs().max().item()), (name, err)
    return want.item()


def _check_case(tmp_path, index: int) -> None:
    config, refused = R.draw(index)
    d, ref = _saved(tmp_path, index, config)
    if refused:
        _check_refused(d, refused)
        return
    ids = R.tokens(ref.config, index)
    ours = load_hf(d)
    assert ours.cfg.moe_layer_ids == tuple(R.sparse_layers(config)) or \
        list(ours.cfg.moe_layer_ids) == R.sparse_layers(config)
    with torch.no_grad():
        want = ref(ids).logits
        err = (ours.eval()(ids) - want).abs().max().item()
    assert err <= LOGIT_TOL, (index, err)
    loss = _check_training(ours, ref, ids)

    out = _exported(tmp_path, d, shard_bytes=random.Random(index).choice([5 * 2**30, 30_000]))
    back = R.read(out)
    theirs = back.state_dict()
    for name, tensor in ref.state_dict().items():  # the very weights transformers wrote, under its own names (but
        # the gate of a 0-wide shared expert, which gates nothing: the export writes it zero, docs/moe.md)
        assert torch.equal(tensor, theirs[name]) or name.endswith("shared_expert_gate.weight") and \
            not config.get("shared_expert_intermediate_size"), name
    with torch.no_grad():  # (equal up to rounding: transformers' kernels sum in another order where the export's
        # per-expert tensors were read into memory other than the source's fused ones, or its never-binding window
        # masked by window where the export's full attention masks by causality alone; 2e-7 to 7e-7 seen)
        err = (back(ids).logits - want).abs().max().item()
    assert err <= 2e-6, (index, err)
    assert abs(R.reference_loss(back, ids).item() - loss) <= 1e-6 * max(1.0, abs(loss))


@pytest.mark.parametrize("index", [i for i in CASES if i in FAST])
def test_moe_families_import_train_and_export_as_transformers(tmp_path, index):
    _check_case(tmp_path, index)


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i in CASES if i not in FAST])
def test_moe_families_import_train_and_export_as_transformers_all(tmp_path, index):
    _check_case(tmp_path, index)


def test_the_draws_cover_the_knobs():
    """Across the 32 draws: every family; every refusal; top-k 1 and all the experts; norm_topk_prob both ways;
    dense layers by both Qwen keys; a shared expert of 0 and of some width; output_router_logits both ways; a z-loss;
    GQA; a head_dim that is not hidden / heads; both tie and bias settings; a window; a RoPE scaling."""
    drawn = [R.draw(i) for i in CASES]
    ok = [c for c, refused in drawn if not refused]
    assert {c["model_type"] for c in ok} == set(R.FAMILIES)
    kinds = {k for k, pattern in R.REFUSALS.items() for _, refused in drawn
             if refused and refused.startswith(pattern.split("{")[0])}
    assert kinds == set(R.REFUSALS), kinds
    experts = [(c.get("num_experts") or c.get("num_local_experts"), c["num_experts_per_tok"]) for c in ok]
    assert any(k == 1 for _, k in experts) and any(k == e > 1 for e, k in experts)
    assert {c["norm_topk_prob"] for c in ok if "norm_topk_prob" in c} == {True, False}
    assert any(c.get("decoder_sparse_step", 1) > 1 for c in ok) and any(c.get("mlp_only_layers") for c in ok)
    assert {bool(c["shared_expert_intermediate_size"]) for c in ok if c["model_type"] == "qwen2_moe"} == {True, False}
    assert {c["output_router_logits"] for c in ok} == {True, False}
    assert any(c.get("router_z_loss_coef") for c in ok)
    assert any(c["num_key_value_heads"] < c["num_attention_heads"] for c in ok)
    assert any(c.get("head_dim") and c["head_dim"] * c["num_attention_heads"] != c["hidden_size"] for c in ok)
    assert {c["tie_word_embeddings"] for c in ok} == {True, False}
    assert any(c.get("sliding_window") for c in ok) and any(c["rope_scaling"] for c in ok)


@pytest.mark.parametrize("family, top_k", [("qwen3_moe", 3), ("mixtral", 5), ("olmoe", 0)])
def test_more_experts_per_token_than_the_model_has_is_refused_naming_the_key(tmp_path, family, top_k):
    """num_experts_per_tok outside 1..experts (what the fuzz found): transformers builds the model and fails in its
    forward's top-k; load_hf built it too and failed there with a bare "selected index k out of range", and a run
    from it stopped at model.moe.top_k, a key its user never set. Both now name config.json's keys."""
    experts = "num_local_experts" if family == "mixtral" else "num_experts"
    config = dict(model_type=family, architectures=[R.ARCH[family]], hidden_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=8, moe_intermediate_size=8,
                  vocab_size=40, max_position_embeddings=32, num_experts_per_tok=top_k, **{experts: 2})
    d = tmp_path / "hf"
    R.save(R.build(config, seed=0), d, fused=False, shard=None)
    # (transformers 5 writes Qwen3-MoE's count as num_local_experts, whichever name it was given)
    _check_refused(d, rf"num_experts_per_tok={top_k} with num_\w*experts=2: each token chooses between 1 and 2 experts")
