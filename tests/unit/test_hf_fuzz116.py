"""A seeded randomized audit of Hugging Face import and export against transformers itself.

Each case draws a tiny config of one family longctx reads (every one of hf_families.FAMILIES, five cases
each) with random values of the keys that change the computation: heads, kv heads and a head_dim that is not
hidden / heads, tied heads, the family's attention biases, rms_norm_eps, rope_theta, every RoPE type the
importer reads (linear, llama3, yarn with random betas, mscale, attention_factor, truncate, a top-level
original length) in either config.json form, sliding windows (Mistral's and Mixtral's, Qwen's
use_sliding_window / max_window_layers / layer_types), and the experts (count, top-k, norm_topk_prob, Qwen2-MoE's
shared expert, decoder_sparse_step, mlp_only_layers). transformers builds and saves the model; its float64
logits on random tokens that cross the RoPE original length are the reference for longctx's float64 import.
The run's own path (model.init_from = hf:DIR) then saves a checkpoint, `longctx checkpoint export` writes it
back, and transformers reads the export: the same weights, windows, RoPE tables and routing settings, and
logits equal to the source's. Fourteen cases draw something longctx does not compute (dynamic or longrope RoPE,
a partial rotary factor, GELU, a window shorter than the tokens, Llama's mlp_bias, Mistral's attention biases,
OLMoE's clip_qkv, a Qwen-MoE with no layer of experts): each must be refused by both readers (load_hf and the
run's config) with an error that names it. The all-dense Qwen-MoE is what the fuzz found: load_hf read it, and
every run stopped at "set model.moe.experts 0", which the weights' expert count then refused (regression test:
test_a_qwen_moe_whose_every_layer_is_dense_is_refused_naming_its_dense_family).

Both sides rotate in fp32 (transformers casts its angles to float; longctx keeps its frequencies fp32), so
float64 logits agree to the fp32 RoPE tables' rounding, not to float64's: TOL bounds that (observed < 3e-6).
"""

import json
import random
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
import torch.distributed.checkpoint as dcp  # noqa: E402

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import write_manifest  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.hf import HFFormatError, model_fields_from_hf  # noqa: E402
from longctx.config.hf_families import FAMILIES  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402
from longctx.models.hf import load_hf, load_hf_weights  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402

SEQ, TOL, PER_FAMILY = 40, 2e-5, 5
TURNS = ("yarn", "linear", "llama3", "yarn", "default", "llama3")  # (the RoPE types by turn: the scalings' knobs
# are the most, so they come more often)
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
QWEN_LAYER_TYPES = ("qwen2", "qwen3", "qwen2_moe")
WINDOWED = ("mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# what each refusal's error must name (the drawn value filled in)
REFUSALS = {"dynamic": "RoPE type 'dynamic' is not supported", "longrope": "RoPE type 'longrope' is not supported",
            "partial_rotary": "partial_rotary_factor={}", "gelu": "hidden_act '{}'", "window": r"sliding_window={}\b",
            "mlp_bias": "mlp_bias=true", "attention_bias": "attention_bias=true", "clip_qkv": "clip_qkv={}",
            "all_dense": "leave none of the .* layers with experts"}


def _refusals(family: str) -> list[str]:
    return (["dynamic", "longrope", "partial_rotary", "gelu"] + (["window"] if family in WINDOWED else [])
            + {"llama": ["mlp_bias"], "mistral": ["attention_bias"], "olmoe": ["clip_qkv"], "qwen2_moe": ["all_dense"],
               "qwen3_moe": ["all_dense"]}.get(family, []))


def _shapes(rng: random.Random, family: str, kind: str) -> dict:
    heads = rng.choice([2, 4, 6])
    # (YaRN's heads wide: its correction band then falls between pairs, where betas and truncate change the tables)
    head_dim = rng.choice([32, 64] if kind == "yarn" else [8, 12, 32, 64])
    # (transformers wants hidden_size a multiple of the heads, not heads x head_dim)
    hidden = heads * (head_dim if family == "olmoe" or rng.random() < 0.4 else rng.choice([6, 10, 20]))
    d = dict(model_type=family, architectures=[FAMILIES[family]], hidden_size=hidden, num_attention_heads=heads,
             num_key_value_heads=rng.choice([k for k in range(1, heads + 1) if heads % k == 0]),
             num_hidden_layers=rng.randint(2, 4), intermediate_size=rng.choice([32, 48, 64]),
             vocab_size=rng.randint(64, 160), rms_norm_eps=10 ** rng.uniform(-6, -0.5),
             tie_word_embeddings=rng.random() < 0.4, initializer_range=0.1, hidden_act="silu",
             max_position_embeddings=rng.choice([SEQ, 48, 64, 96]))
    if hidden != heads * head_dim or rng.random() < 0.5:
        d["head_dim"] = head_dim
    return d


def _rope(rng: random.Random, d: dict, kind: str, refuse: str | None) -> dict:
    """rope_parameters (theta inside) of type `kind`."""
    p = {"rope_type": kind, "rope_theta": round(10 ** rng.uniform(2, 6), 3)}
    # (short ones the tokens cross; long ones put YaRN's correction range and llama3's smooth band inside the head,
    # where beta_fast / beta_slow, truncate, low / high_freq_factor and the original length itself change the tables)
    original = rng.choice([8, 16, 512, 4096])
    if kind in ("linear", "dynamic"):
        p["factor"] = round(rng.uniform(1.25, 6), 2)
    elif kind == "llama3":
        low = round(rng.uniform(0.5, 2), 2)
        p.update(factor=round(rng.uniform(2, 8), 2), low_freq_factor=low,
                 high_freq_factor=round(low + rng.uniform(0.5, 6), 2))
        if rng.random() < 0.7:
            p["original_max_position_embeddings"] = original
    elif kind == "yarn":  # (mostly long: with a short original every beta is past the head's last pair)
        original = rng.choice([16, 2048, 4096])
        p.update(factor=round(rng.uniform(1.5, 6), 2), original_max_position_embeddings=original)
        for key, lo, hi in (("beta_fast", 4, 64), ("beta_slow", 0.25, 2), ("mscale", 0.5, 2),
                            ("mscale_all_dim", 0.25, 2), ("attention_factor", 0.5, 1.5)):
            if rng.random() < 0.5:
                p[key] = round(rng.uniform(lo, hi), 3)
        if rng.random() < 0.5:
            p["truncate"] = rng.random() < 0.5
        if rng.random() < 0.25:  # (Phi-3 style: a top-level original length wins over the settings')
            d["original_max_position_embeddings"] = rng.choice([n for n in (12, 256, 2048) if n != original])
    elif kind == "longrope":
        half = d.get("head_dim", d["hidden_size"] // d["num_attention_heads"]) // 2
        p.update(original_max_position_embeddings=original, short_factor=[1.0] * half,
                 long_factor=[round(rng.uniform(1, 4), 2) for _ in range(half)])
    if refuse == "partial_rotary":
        p["partial_rotary_factor"] = rng.choice([0.25, 0.5, 0.75])
    elif rng.random() < 0.15:
        p["partial_rotary_factor"] = 1.0
    return p


def _window(rng: random.Random, d: dict, refuse: str | None) -> int | None:
    """The window keys of a windowed family; the window the case must be refused for (shorter than the
    tokens, in a layer transformers windows) when drawn as the refusal, else None."""
    family, layers = d["model_type"], d["num_hidden_layers"]
    short = rng.randint(8, SEQ - 1)
    long = d["max_position_embeddings"] * (d["rope_parameters"].get("factor", 1) if
                                           d["rope_parameters"]["rope_type"] == "linear" else 1)
    window = short if refuse == "window" else int(long) + rng.randint(0, 40)
    if family in ("mistral", "mixtral"):
        d["sliding_window"] = window if refuse == "window" or rng.random() < 0.5 else None
        return window if refuse == "window" else None
    on = refuse == "window" or rng.random() < 0.6
    d.update(use_sliding_window=on, sliding_window=window if on or rng.random() < 0.5 else short)
    if family == "qwen3_moe":
        return window if refuse == "window" else None
    # windowed layers: Qwen2 / Qwen3 from max_window_layers on, Qwen2-MoE even layers below it
    d["max_window_layers"] = rng.randint(0, layers) if refuse != "window" else 0 if family != "qwen2_moe" else layers
    if on and family in QWEN_LAYER_TYPES and rng.random() < 0.4:  # an explicit layer_types wins
        kinds = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]
        if refuse == "window":
            kinds[rng.randrange(layers)] = "sliding_attention"
        d["layer_types"] = kinds
    return window if refuse == "window" else None


def _moe(rng: random.Random, d: dict, all_dense: bool) -> None:
    """The expert keys; a Qwen-MoE's mlp_only_layers and decoder_sparse_step leave no layer with experts
    exactly when `all_dense` (a refusal)."""
    family, layers = d["model_type"], d["num_hidden_layers"]
    experts = rng.randint(2, 6)
    d.update(num_experts_per_tok=rng.randint(1, min(3, experts)), output_router_logits=rng.random() < 0.3)
    if family == "mixtral":
        d["num_local_experts"] = experts
        return
    d.update(num_experts=experts, norm_topk_prob=rng.random() < 0.5)
    if family in ("qwen2_moe", "qwen3_moe"):
        d.update(moe_intermediate_size=rng.choice([16, 24, 32]), decoder_sparse_step=rng.randint(1, 3),
                 mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))))
    if family == "qwen2_moe":
        d["shared_expert_intermediate_size"] = rng.choice([0, 16, 40])
    sparse = [i for i in range(layers) if i not in d.get("mlp_only_layers", ()) and
              (i + 1) % d.get("decoder_sparse_step", 1) == 0]
    if all_dense:  # (by either key)
        d.update(rng.choice([dict(decoder_sparse_step=layers + 1), dict(mlp_only_layers=list(range(layers)))]))
    elif not sparse:
        d.update(decoder_sparse_step=1, mlp_only_layers=[])


def draw(name: str) -> tuple[dict, str | None, bool]:
    """(config for transformers, the error the case must be refused with or None, write the classic
    rope_theta + rope_scaling form) of the case `name` ("qwen2_moe-3")."""
    family, index = name.rsplit("-", 1)
    rng = random.Random(f"hffuzz116-{name}")
    # (case 0 draws the family's own refusal, case 1 of every other family one of RoPE's or the activation's)
    kinds, position = _refusals(family), list(FAMILIES).index(family)
    refuse = {"0": kinds[-1], "1": kinds[position // 2 % 4] if position % 2 == 0 else None, "2": kinds[-2] if position
              in (1, 6) else None}.get(index)  # (and Mistral's and Qwen3-MoE's window)
    # (the RoPE type: each family's cases take TURNS in turn; the refused ones only when drawn as the refusal)
    kind = refuse if refuse in ("dynamic", "longrope") else TURNS[(position + int(index)) % len(TURNS)]
    d = _shapes(rng, family, kind)
    d["rope_parameters"] = _rope(rng, d, kind, refuse)
    said = {"partial_rotary": d["rope_parameters"].get("partial_rotary_factor")}
    if family in WINDOWED:
        said["window"] = _window(rng, d, refuse)
    if family in MOE:
        _moe(rng, d, all_dense=refuse == "all_dense")
    if family in ("llama", "qwen3", "qwen3_moe", "olmoe"):
        d["attention_bias"] = rng.random() < 0.5
    if family == "qwen2_moe":
        d["qkv_bias"] = rng.random() < 0.5
    if refuse == "mlp_bias":
        d["mlp_bias"] = True
    elif refuse == "attention_bias":
        d["attention_bias"] = True
    elif refuse == "gelu":
        d["hidden_act"] = said["gelu"] = rng.choice(["gelu", "gelu_pytorch_tanh"])
    elif refuse == "clip_qkv":
        d["clip_qkv"] = said["clip_qkv"] = rng.choice([4.0, 8.0])
    pattern = REFUSALS[refuse].format(said.get(refuse)) if refuse else None
    return d, pattern, rng.random() < 0.5


CASES = [f"{family}-{i}" for family in FAMILIES for i in range(PER_FAMILY)]


def _saved(tmp_path, config: dict, classic: bool):
    """The directory transformers' save_pretrained writes for a random model of `config` (norms, biases and
    routers randomised: initialised to 1, 0 and near-ties, they hide a wrong mapping), with config.json rewritten
    to the classic form when `classic`; and transformers' float64 model read back from it."""
    torch.manual_seed(116)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**json.loads(json.dumps(config)))).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.normal_(0, 0.3)
    d = tmp_path / "hf"
    model.save_pretrained(d)
    top = config.get("original_max_position_embeddings")
    original = config.get("rope_parameters", {}).get("original_max_position_embeddings")
    if top and original:  # (transformers saved the top-level one in the settings too: the file says both, as Phi-3's)
        written = json.loads((d / "config.json").read_text())
        written["rope_parameters"]["original_max_position_embeddings"] = original
        (d / "config.json").write_text(json.dumps(written))
    if classic:  # (transformers 4's form: rope_theta beside rope_scaling, which transformers 5 reads as well)
        written = json.loads((d / "config.json").read_text())
        rope = written.pop("rope_parameters")
        written["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:  # (top-level then, as Phi and StableLM write it)
            written["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        written["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        (d / "config.json").write_text(json.dumps(written))
    return d, _read(d)


def _read(d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (its grouped experts refuse float64: the per-expert loop)
        return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64,
                                                                 experts_implementation="eager").eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1160))


def _windows(model) -> list:
    """The window transformers gives each layer (None: full causal attention), from its config as its models
    read it: every layer of Mistral, Mixtral and Qwen3-MoE; by layer_types in Qwen2, Qwen3 and Qwen2-MoE."""
    c = model.config
    if c.model_type in QWEN_LAYER_TYPES:
        return [c.sliding_window if kind == "sliding_attention" else None for kind in c.layer_types]
    return [getattr(c, "sliding_window", None) if c.model_type in WINDOWED else None] * c.num_hidden_layers


def meaning(model) -> dict:
    """What a transformers model computes with, beyond the values of its weights: every tensor's name and shape
    (biases, q/k norms, experts, shared experts, sparse and dense layers), the norms' eps, the RoPE tables it
    rotates by, each layer's window, the head counts, the tie, the routing settings."""
    c, rope = model.config, model.model.rotary_emb
    return dict(shapes={k: tuple(v.shape) for k, v in model.state_dict().items()},
                eps=sorted({m.variance_epsilon for m in model.modules() if hasattr(m, "variance_epsilon")}),
                rope=(rope.rope_type, rope.inv_freq.tolist(), float(rope.attention_scaling)),
                windows=_windows(model), tied=model.lm_head.weight is model.model.embed_tokens.weight,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                **{k: getattr(c, k, None) for k in ("num_attention_heads", "num_key_value_heads", "hidden_act",
                                                    "num_experts_per_tok", "norm_topk_prob")})


def _checkpoint(tmp_path, d):
    """A longctx checkpoint of the run that starts from hf:`d` (its config as the loader resolves it, the weights
    read into it): what `longctx checkpoint export` reads."""
    config = load_config(overrides=[f"--model.init_from=hf:{d}", f"--train.seq_len={SEQ}"])
    run = config.model
    model = build_model(run, device="meta")
    model.to_empty(device="cpu")
    load_hf_weights(model, d)
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    with warnings.catch_warnings():  # (DCP's "assuming the intent is to save in a single process")
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_manifest(step, step=1, layout={}, model=to_dict(config)["model"])
    return step, run


def _same_model(a, b) -> None:
    """Two longctx model configs that compute the same function (the length they are trusted with aside)."""
    skip = {"max_seq_len", "init_from", "preset"}
    da, db = (dict(vars(x)) for x in (a, b))
    assert {k: v for k, v in da.items() if k not in skip} == {k: v for k, v in db.items() if k not in skip}


@pytest.mark.parametrize("name", CASES)  # (all 40 in about 20 s on one core: none is slow)
def test_import_and_export_compute_what_transformers_computes(tmp_path, name):
    config, refused, classic = draw(name)
    d, ref = _saved(tmp_path, config, classic)
    if refused:
        with pytest.raises(HFFormatError, match=refused):
            load_hf(d)
        with pytest.raises(HFFormatError, match=refused):
            load_config(overrides=[f"--model.init_from=hf:{d}", f"--train.seq_len={SEQ}"])
        return
    tokens = _tokens(config["vocab_size"])
    with torch.no_grad():
        want = ref(tokens).logits
        ours = load_hf(d, dtype=torch.float64)
        err = (ours(tokens) - want).abs().max().item()
    assert err <= TOL, (name, err, want.abs().max().item())

    step, run = _checkpoint(tmp_path, d)
    _same_model(run, ours.cfg)
    out = export_hf(step, tmp_path / "export")[0]
    back = _read(out)
    assert meaning(back) == meaning(ref)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, want)
    _same_model(load_hf(out).cfg, ours.cfg)
    written = json.loads((out / "config.json").read_text())
    assert model_fields_from_hf(written)["family"] == config["model_type"]


def test_the_draws_cover_what_they_claim():
    """Across the cases: every family, RoPE type and refusal, both config.json forms, tied and untied heads, a
    head_dim that is not hidden / heads, windows that bind and that do not, and the MoE settings' both ways."""
    drawn = [(n, *draw(n)) for n in CASES]
    seen = {c["model_type"] for _, c, _, _ in drawn}
    assert seen == set(FAMILIES)
    accepted = [c for _, c, refused, _ in drawn if not refused]
    assert {c["rope_parameters"]["rope_type"] for c in accepted} == {"default", "linear", "llama3", "yarn"}
    refusals = {key for key, said in REFUSALS.items() for _, _, refused, _ in drawn
                if refused and refused.startswith(said.split("{")[0])}
    assert refusals == set(REFUSALS)
    assert {classic for *_, classic in drawn} == {True, False}
    assert {c["tie_word_embeddings"] for c in accepted} == {True, False}
    assert any(c.get("head_dim") and c["head_dim"] * c["num_attention_heads"] != c["hidden_size"] for c in accepted)
    assert any(c.get("sliding_window") and (c["model_type"] in ("mistral", "mixtral") or c.get("use_sliding_window"))
               for c in accepted)
    moe = [c for c in accepted if c["model_type"] in MOE]
    assert {c.get("norm_topk_prob") for c in moe if c["model_type"] != "mixtral"} == {True, False}
    assert {c["num_experts_per_tok"] for c in moe} >= {1, 2, 3}
    assert {bool(c.get("shared_expert_intermediate_size")) for c in moe if c["model_type"] == "qwen2_moe"} == {
        True, False}
    assert any(c.get("decoder_sparse_step", 1) > 1 or c.get("mlp_only_layers") for c in moe)
    yarn = [c["rope_parameters"] for c in accepted if c["rope_parameters"]["rope_type"] == "yarn"]
    assert {k for p in yarn for k in p} >= {"beta_fast", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


@pytest.mark.parametrize("family, dense, keys", [("qwen3_moe", "qwen3", dict(decoder_sparse_step=3)),
                                                 ("qwen2_moe", "qwen2", dict(mlp_only_layers=[0, 1], qkv_bias=True))])
def test_a_qwen_moe_whose_every_layer_is_dense_is_refused_naming_its_dense_family(tmp_path, family, dense, keys):
    """mlp_only_layers / decoder_sparse_step that leave no layer with experts: load_hf read the dense model, and
    every run stopped at "set model.moe.experts 0", which the weights' num_experts refused in turn. Now both say
    so, and the family they name reads the same weights as transformers computes them."""
    config = dict(model_type=family, architectures=[FAMILIES[family]], hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_experts=3,
                  num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                  initializer_range=0.1, **keys)
    d, ref = _saved(tmp_path, config, classic=False)
    said = f"leave none of the 2 layers with experts.*model_type {dense}.* and head_dim 8"
    with pytest.raises(HFFormatError, match=said):
        load_hf(d)
    with pytest.raises(HFFormatError, match=said):
        load_config(overrides=[f"--model.init_from=hf:{d}", f"--train.seq_len={SEQ}"])
    written = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**written, "model_type": dense, "architectures": [FAMILIES[dense]],
                                                  "head_dim": 8}))  # (as the error says)
    tokens = _tokens(64)
    with torch.no_grad():
        assert (load_hf(d, dtype=torch.float64)(tokens) - ref(tokens).logits).abs().max().item() <= TOL
