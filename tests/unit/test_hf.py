"""Our model against transformers on random tiny checkpoints of every supported family and RoPE
type (fp32, logits within 1e-4): loading, exporting, and the errors for what we cannot read."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.config.hf import HFFormatError  # noqa: E402
from longctx.models.hf import config_from_hf, load_hf, save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402

TOL = 1e-4
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# original_max_position_embeddings is small, so positions up to 200 reach every frequency band
ROPES = {
    "default": None,
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    "yarn-mscale": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, mscale=0.707,
                        mscale_all_dim=1.0, beta_fast=16.0, beta_slow=2.0),
    "yarn-attention-factor": dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64,
                                  attention_factor=1.3, truncate=False),
}
# each family meets every RoPE type; config form, tying, GQA and an explicit head_dim rotate through the cases
CASES = [(family, rope, ("classic", "rope_parameters")[(i + j) % 2], bool((i + j // 2) % 2), j % 3 != 2)
         for i, family in enumerate(FAMILIES) for j, rope in enumerate(ROPES)]
ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM"}


def case_id(case):
    family, rope, form, tie, gqa = case
    return f"{family}-{rope}-{form}-{'tied' if tie else 'untied'}-{'gqa' if gqa else 'mha'}"


def hf_config(family="llama", rope="default", form="classic", tie=False, gqa=True, **extra):
    """A config.json dict as transformers writes it, in the classic (rope_theta + rope_scaling) or
    newer (rope_parameters) form."""
    d = dict(model_type=family, architectures=[ARCH[family]], hidden_size=64, intermediate_size=160,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2 if gqa else 4, vocab_size=300,
             rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=tie, hidden_act="silu",
             torch_dtype="float32", initializer_range=0.1)  # large: logits of order 1 make 1e-4 a strict bound
    if family in ("mistral", "qwen3"):
        d["head_dim"] = 32  # explicit, and not hidden_size / heads
    if family in ("mistral", "qwen2", "qwen3"):
        d["sliding_window"] = None
    if family == "qwen3":
        d["attention_bias"] = gqa  # Qwen3 with and without the optional q/k/v/o bias
    theta = 10000.0 if rope == "default" else 500000.0
    scaling = ROPES[rope]
    if form == "classic":
        d.update(rope_theta=theta, rope_scaling=scaling)
    else:
        d["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    d.update(extra)
    return d


def random_hf_dir(tmp_path, config: dict, shards=1, name="hf"):
    """A random checkpoint made by transformers itself (independent of our writer): config.json
    exactly as given, weights in `shards` safetensors files."""
    cfg = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise so a wrong mapping shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.normal_(0, 0.1)
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    names = list(state)
    if shards == 1:
        save_file(state, str(d / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: state[n] for n in names[i::shards]}, str(d / fname))
            weight_map.update({n: fname for n in names[i::shards]})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d, model


def tokens(vocab=300, seq=200):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(5))


def max_err(ours, theirs, t=None):
    t = tokens() if t is None else t
    with torch.no_grad():
        return (ours(t) - theirs(t).logits).abs().max().item()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_load_and_export_match_transformers(tmp_path, case):
    family, rope, form, tie, gqa = case
    config = hf_config(family, rope, form, tie, gqa)
    d, ref = random_hf_dir(tmp_path, config, shards=1 if form == "classic" else 3)
    ours = load_hf(d)
    assert ours.cfg.family == family and ours.cfg.tie_embeddings == tie
    assert ours.cfg.rope_scaling == ("none" if rope == "default" else ROPES[rope]["rope_type"])
    assert max_err(ours, ref) <= TOL
    # export, reload in transformers, match again; and our reader gives back the same config and weights
    out = save_hf(ours, tmp_path / "export", max_shard_bytes=100_000)  # forces several shards
    assert (out / "model.safetensors.index.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == ARCH[family]
    assert max_err(ours, theirs) <= TOL
    back = load_hf(out)
    assert back.cfg == ours.cfg
    for (n, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n


def test_parity_check_can_fail(tmp_path):
    """The comparison is sensitive to the classic mapping bug (q/k rows in Meta's interleaved RoPE
    order instead of the half-split one), to a missing q/k norm and to YaRN's attention factor."""
    d, ref = random_hf_dir(tmp_path, hf_config("qwen3", "yarn"))
    ours = load_hf(d)
    assert max_err(ours, ref) <= TOL
    hd = ours.cfg.resolved_head_dim
    interleave = torch.arange(hd).view(2, hd // 2).t().reshape(-1)  # 0, hd/2, 1, hd/2+1, ...
    with torch.no_grad():
        for layer in ours.layers:
            for w in (layer.attention.wq.weight, layer.attention.wk.weight):
                heads = w.shape[0] // hd
                w.copy_(w.view(heads, hd, -1)[:, interleave].reshape_as(w))
    assert max_err(ours, ref) > 100 * TOL
    for broken in ("q_norm", "rope_scale"):
        ours = load_hf(d)
        if broken == "q_norm":
            for layer in ours.layers:
                layer.attention.q_norm = None
        else:
            ours.rope_scale = 1.0
        assert max_err(ours, ref) > 100 * TOL, broken


def test_random_model_of_each_family_exports_to_transformers(tmp_path):
    """A model trained from scratch (no init_from) exports as its family, in fp32 and bf16."""
    for family, extra in (("qwen2", ["--model.qkv_bias=true"]), ("qwen3", ["--model.qk_norm=true"]),
                          ("mistral", ["--model.head_dim=48"]), ("llama", ["--model.rope_scaling=yarn"])):
        cfg = load_config(overrides=["--model.dim=64", "--model.ffn_dim=160", "--model.layers=2",
                                     f"--model.family={family}", "--model.rope_original_max_len=32", *extra]).model
        ours = build_model(cfg, seed=7)
        out = save_hf(ours, tmp_path / family)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert max_err(ours, theirs, tokens(vocab=cfg.vocab_size)) <= TOL, family
    half = save_hf(ours, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_hf(half, dtype=torch.bfloat16)
    assert back.tok_embeddings.weight.dtype == torch.bfloat16 and back.inv_freq.dtype == torch.float32
    assert torch.equal(back.tok_embeddings.weight, ours.tok_embeddings.weight.bfloat16())


def test_export_copies_tokenizer_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text("{}")
    cfg = load_config(overrides=["--model.layers=1"]).model
    out = save_hf(build_model(cfg), tmp_path / "out", tokenizer_from=src)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"]


def test_bad_checkpoints_are_explained(tmp_path):
    with pytest.raises(HFFormatError, match="no config.json"):
        load_hf(tmp_path)
    base = hf_config("llama")
    for bad, match in [
        (dict(model_type="gemma"), "model_type 'gemma' is not supported"),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "RoPE type 'longrope' is not supported"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
        (dict(rope_scaling={"rope_type": "linear"}), "needs 'factor'"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(model_type="mistral", sliding_window=64), "sliding-window"),
        (dict(model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1), "sliding-window"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ]:
        with pytest.raises(HFFormatError, match=match):
            config_from_hf({**base, **bad}, "x/config.json")
    d, _ = random_hf_dir(tmp_path, hf_config("qwen2"), shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HFFormatError, match="model-00002-of-00002.safetensors"):
        load_hf(d)
    # and before any rank is launched, said once (exit 2, one paragraph, no traceback)
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--nproc=4", f"--model.init_from=hf:{d}",
                        "--train.seq_len=128", "--train.steps=1"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("model-00002-of-00002.safetensors") == 1 and "rank" not in r.stderr
    for f in d.glob("model*"):
        f.unlink()
    with pytest.raises(HFFormatError, match="neither model.safetensors"):
        load_hf(d)
    # weights that disagree with config.json: named, not a size-mismatch traceback
    d2, _ = random_hf_dir(tmp_path, hf_config("llama"), name="hf2")
    cfg = json.loads((d2 / "config.json").read_text())
    (d2 / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(HFFormatError, match="mlp.gate_proj.weight has shape"):
        load_hf(d2)


def test_init_from_makes_the_checkpoint_config_the_run_model(tmp_path):
    from longctx.config import to_toml

    d, _ = random_hf_dir(tmp_path, hf_config("qwen3", "yarn", tie=True))
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}", "--model.rope_theta=1000000", "--train.seq_len=256"])
    m = cfg.model
    shape = (m.preset, m.family, m.dim, m.heads, m.kv_heads, m.head_dim, m.vocab_size)
    assert shape == ("hf", "qwen3", 64, 4, 2, 32, 300)
    assert m.qk_norm and m.tie_embeddings and m.rope_scaling == "yarn" and m.rope_original_max_len == 32
    assert m.rope_theta == 1e6  # the extension override on top
    # the run's config.toml loads back to the same model (every key explicit, none contradicting)
    (tmp_path / "run.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "run.toml").model == m
    with pytest.raises(HFFormatError, match=r"model.dim=256 contradicts the weights .* hidden_size=64"):
        load_config(overrides=[f"--model.init_from=hf:{d}", "--model.dim=256"])
    with pytest.raises(HFFormatError, match="model.layers=3 contradicts"):
        load_config(overrides=[f"--model.init_from=hf:{d}", "--model.layers=3"])
    from longctx.config.hf import resolve_init_from

    fields, changed = resolve_init_from({"init_from": f"hf:{d}", "preset": "llama3-8b", "rope_theta": 1e6})
    assert fields["dim"] == 64 and fields["preset"] == "hf"  # a recipe's preset yields to the checkpoint, loudly
    assert changed == [f"model.preset 'llama3-8b' replaced by the shapes of {d / 'config.json'}",
                       "model.rope_theta: 500000.0 -> 1000000.0"]
    with pytest.raises(HFFormatError, match="not a directory"):
        load_config(overrides=[f"--model.init_from=hf:{tmp_path / 'nowhere'}"])
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError, match="preset=hf"):
        load_config(overrides=["--model.preset=hf"])


def test_swish_is_silu(tmp_path):
    """transformers' hidden_act "swish" is torch's SiLU, as "silu" is: such a model was refused as unsupported."""
    d, ref = random_hf_dir(tmp_path, hf_config("llama", hidden_act="swish"))
    assert max_err(load_hf(d), ref) <= TOL
