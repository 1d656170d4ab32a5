"""Reference side of the Hugging Face MoE audit (tests/unit/test_hfmoe_fuzz120.py): seeded random tiny configs of
the four Mixture-of-Experts families longctx reads (mixtral, qwen2_moe, qwen3_moe, olmoe), the transformers model of
each with random weights written by save_pretrained (per-expert or fused tensors, one file or shards), and what
transformers computes from them: logits, the training loss of model(ids, labels=ids) with the router losses its
config adds, and every parameter's gradient of that loss under longctx's parameter names.

The one term transformers never adds is router_z_loss_coef, a key only longctx's export writes (config/hf.py): where
a draw sets it, the expected loss is transformers' plus that weight times the z-loss written out here from the
routers' logits (ST-MoE's mean over tokens of logsumexp^2, averaged over the MoE layers), not from longctx's code.
"""

from __future__ import annotations

import json
import random
import warnings

import torch
import transformers

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "olmoe": "OlmoeForCausalLM"}
SEQ = 24
# each refusal drawn -> what its error must say ({} filled with the drawn value)
REFUSALS = {"clip_qkv": r"clip_qkv={}", "window": r"sliding_window={}\b", "all_dense": "leave none of the",
            "gelu": "hidden_act '{}'", "olmoe_head_dim": "OLMoE's q/k norms span hidden_size",
            "top_k": r"num_experts_per_tok={} with num_\w*experts={}"}


def _attention(rng: random.Random, family: str) -> dict:
    heads = rng.choice([2, 4, 6])
    head_dim = rng.choice([4, 8, 12])
    # (transformers wants hidden a multiple of the heads; OLMoE's q/k norms want exactly heads x head_dim)
    hidden = heads * (head_dim if family == "olmoe" or rng.random() < 0.5 else rng.choice([6, 10]))
    d = dict(hidden_size=hidden, num_attention_heads=heads,
             num_key_value_heads=rng.choice([k for k in range(1, heads + 1) if heads % k == 0]))
    if hidden != heads * head_dim or rng.random() < 0.4:
        d["head_dim"] = head_dim
    return d


def _rope(rng: random.Random) -> dict:
    theta = round(10 ** rng.uniform(2, 6), 2)
    kind = rng.choice(["default", "default", "linear", "yarn", "llama3"])
    scaling = {"linear": dict(rope_type="linear", factor=round(rng.uniform(1.5, 4), 2)),
               "yarn": dict(rope_type="yarn", factor=round(rng.uniform(1.5, 4), 2),
                            original_max_position_embeddings=16),
               "llama3": dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=16)}.get(kind)
    return dict(rope_theta=theta, rope_scaling=scaling)


def _experts(rng: random.Random, family: str, layers: int) -> dict:
    experts = rng.choice([1, 2, 3, 4, 4, 5, 6, 8])
    d = dict(num_experts_per_tok=rng.randint(1, experts), output_router_logits=rng.random() < 0.6,
             router_aux_loss_coef=round(rng.uniform(0.01, 0.5), 3))
    if family == "mixtral":
        d.update(num_local_experts=experts, router_jitter_noise=0.0)
        return d
    d.update(num_experts=experts, norm_topk_prob=rng.random() < 0.5)
    if family in ("qwen2_moe", "qwen3_moe"):
        d.update(moe_intermediate_size=rng.choice([8, 12, 20]), decoder_sparse_step=rng.randint(1, 3),
                 mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))))
        sparse = [i for i in range(layers) if i not in d["mlp_only_layers"] and (i + 1) % d["decoder_sparse_step"] == 0]
        if not sparse:  # (a Qwen-MoE with no MoE layer is a refusal of its own: drawn only as one)
            d.update(decoder_sparse_step=1, mlp_only_layers=d["mlp_only_layers"][1:])
            if len(d["mlp_only_layers"]) == layers:
                d["mlp_only_layers"] = []
    if family == "qwen2_moe":
        d["shared_expert_intermediate_size"] = rng.choice([0, 0, 12, 24])
    return d


def draw(index: int) -> tuple[dict, str | None]:
    """(the transformers config of case `index`, the refusal it was drawn as or None)."""
    rng = random.Random(f"hfmoe120-{index}")
    family = FAMILIES[index % len(FAMILIES)]
    layers = rng.randint(1, 4)
    d = dict(model_type=family, architectures=[ARCH[family]], num_hidden_layers=layers, vocab_size=rng.randint(40, 90),
             intermediate_size=rng.choice([8, 16, 24]), rms_norm_eps=10 ** rng.uniform(-6, -1),
             tie_word_embeddings=rng.random() < 0.4, max_position_embeddings=rng.choice([SEQ, 32, 64]),
             initializer_range=0.1, hidden_act="silu", **_attention(rng, family), **_rope(rng),
             **_experts(rng, family, layers))
    if family == "mixtral" and (d["rope_scaling"] or {}).get("rope_type") == "yarn":  # (transformers' yarn reads
        d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])  # head_dim, Mixtral's default None)
    if family in ("qwen3_moe", "olmoe"):
        d["attention_bias"] = rng.random() < 0.5
    if family == "qwen2_moe":
        d["qkv_bias"] = rng.random() < 0.5
    if family in ("mixtral", "qwen3_moe", "qwen2_moe") and rng.random() < 0.5:  # (a window that never binds)
        d.update(sliding_window=d["max_position_embeddings"] + rng.randint(0, 8), use_sliding_window=True)
    if rng.random() < 0.25:  # (the key only longctx's export writes, read as moe.z_loss)
        d["router_z_loss_coef"] = round(rng.uniform(0.001, 0.1), 4)
    _ignored_keys(rng, d)
    return _refused(rng, d, REFUSED_CASES.get(index))


# the cases drawn as a refusal (each kind in a family that has it: the index picks the family, index % 4)
REFUSED_CASES = {9: "gelu", 11: "olmoe_head_dim", 12: "window", 14: "all_dense", 18: "window", 25: "all_dense",
                 27: "clip_qkv", 28: "gelu", 30: "top_k"}


def _ignored_keys(rng: random.Random, d: dict) -> None:
    """Keys of another family that transformers' class of this one never reads (Mixtral renormalises whatever
    norm_topk_prob says and has no biases; only Qwen-MoE has dense layers, only Qwen2-MoE shared experts and
    qkv_bias): read by longctx, they would change the model."""
    family, extra = d["model_type"], {}
    if family == "mixtral":
        extra = dict(norm_topk_prob=False, attention_bias=True, moe_intermediate_size=8)
    elif family == "olmoe":
        extra = dict(mlp_only_layers=[0], decoder_sparse_step=2, shared_expert_intermediate_size=8, qkv_bias=True)
    elif family == "qwen3_moe":
        extra = dict(shared_expert_intermediate_size=8, qkv_bias=True)
    elif family == "qwen2_moe":
        extra = dict(attention_bias=not d["qkv_bias"])
    d.update({k: v for k, v in extra.items() if rng.random() < 0.4})


def _refused(rng: random.Random, d: dict, kind: str | None) -> tuple[dict, str | None]:
    """`d` with one thing longctx cannot compute (`kind`, one the family has), or `d` itself."""
    if not kind:
        return d, None
    if kind == "gelu":
        d["hidden_act"] = rng.choice(["gelu", "relu"])
        return d, REFUSALS[kind].format(d["hidden_act"])
    if kind == "clip_qkv":
        d["clip_qkv"] = rng.choice([2.0, 8.0])
        return d, REFUSALS[kind].format(d["clip_qkv"])
    if kind == "window":
        d.update(sliding_window=rng.randint(4, SEQ - 1), use_sliding_window=True)
        return d, REFUSALS[kind].format(d["sliding_window"])
    if kind == "top_k":  # (transformers builds it, and fails in the forward)
        experts = d.get("num_experts") or d["num_local_experts"]
        d["num_experts_per_tok"] = experts + rng.randint(1, 2)
        return d, REFUSALS[kind].format(d["num_experts_per_tok"], experts)
    if kind == "olmoe_head_dim":
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"] + 2
        return d, REFUSALS[kind]
    d.update(rng.choice([dict(decoder_sparse_step=d["num_hidden_layers"] + 1),
                         dict(mlp_only_layers=list(range(d["num_hidden_layers"])))]))
    return d, REFUSALS[kind]


def sparse_layers(config: dict) -> list[int]:
    """The layers transformers builds with experts."""
    layers = config["num_hidden_layers"]
    if config["model_type"] in ("mixtral", "olmoe"):
        return list(range(layers))
    step, only = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    return [i for i in range(layers) if i not in only and (i + 1) % step == 0]


def build(config: dict, seed: int):
    """transformers' fp32 model of `config`, its weights random (norms, biases and routers too: at their
    initial 1, 0 and near-zero a wrong mapping hides)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.AutoConfig.for_model(**json.loads(json.dumps(config)))
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.2)
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.normal_(0, 0.5)
    return model.eval()


def save(model, path, fused: bool, shard: str | None) -> None:
    """save_pretrained: per expert (transformers 4's names, its default) or fused, in one file or shards."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path, save_original_format=not fused, **({"max_shard_size": shard} if shard else {}))


def read(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokens(config, seed: int) -> torch.Tensor:
    """Random token ids [2, SEQ] for the transformers config `config`, none of them its pad_token_id: transformers
    builds the embedding with padding_idx (OLMoE's pad token, id 1), so that row's lookup has no gradient there, and
    longctx, which has no such setting, trains it like any other (a pad token in the inputs is what the difference
    needs; real text holds none, and padding is masked out of longctx's loss)."""
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    pad = config.pad_token_id
    return ids if pad is None else torch.where(ids == pad, (pad + 1) % config.vocab_size, ids)


def z_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss of `model` (transformers') on `ids`: each MoE layer's mean over tokens of
    logsumexp(router logits)^2, averaged over the layers."""
    logits = model(ids, output_router_logits=True).router_logits
    return torch.stack([torch.logsumexp(x.float(), -1).pow(2).mean() for x in logits]).mean()


def reference_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """What transformers trains `model` on for `ids` (model(ids, labels=ids).loss: cross-entropy, plus the pooled
    balancing loss when its config says output_router_logits), plus router_z_loss_coef x z_loss where set."""
    model.train()
    loss = model(ids, labels=ids).loss
    coef = getattr(model.config, "router_z_loss_coef", 0) or 0
    return loss + coef * z_loss(model, ids) if coef else loss


def grads_by_our_name(model, loss: torch.Tensor, ours) -> dict[str, torch.Tensor]:
    """d loss / d every parameter of `model` (transformers'), keyed and shaped as longctx's parameter of the
    same weights (`ours`: its named parameters): fused experts split into w1 (gate) and w3 (up)."""
    from longctx.models.hf import hf_name

    theirs = dict(model.named_parameters())
    grads = dict(zip(theirs, torch.autograd.grad(loss, list(theirs.values()), allow_unused=True)))
    out = {}
    for name, _ in ours:
        if ".feed_forward.experts." in name:
            layer, which = name.split(".")[1], name.rsplit(".", 1)[1]
            base = f"model.layers.{layer}.mlp.experts."
            if which == "w2":
                out[name] = grads[base + "down_proj"]
            else:
                gate_up = grads[base + "gate_up_proj"]
                half = gate_up.shape[1] // 2
                out[name] = gate_up[:, :half] if which == "w1" else gate_up[:, half:]
        elif not name.endswith("router.expert_bias"):
            out[name] = grads[hf_name(name)]
    return out
