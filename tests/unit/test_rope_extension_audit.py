"""Context extension audited for the RoPE tables a forward really uses, against transformers on the same
weights (fp32 logits, compared in float64), at positions past original_max_position_embeddings (64 here;
sequences of up to 240 tokens, factor 4):
- cached decode (chunked prefill, then one token at a time; eager and through the static decode step) with
  linear, llama3 and yarn (its derived attention factor, mscale / mscale_all_dim, explicit attention_factor,
  beta_fast / beta_slow, truncate off) equals transformers' full forward;
- packed documents (positions restarting, document mask): each one's logits are transformers' on it alone;
- Ms-PoE on a yarn model: each kv head turns by yarn's frequencies at p / r, times yarn's attention factor;
- a staged run, an extension run from its checkpoint (yarn and a new rope_theta at init_from, through its
  own stages), a resume in the middle of its later stage, and generation loads of its checkpoint with
  other extension keys: every model computes with the final config's tables, none with stale ones;
- bf16: transformers casts cos and sin to the activations' dtype and rotates in bf16; longctx keeps the
  tables in fp32 and rounds the rotated q / k once (as accurate or more), so it is pinned to that.
Found: the generation guard (config/positions.py) stretched a longctx checkpoint's recorded trained_positions by
its own scaling again, original x factor: a run trained from scratch under a scaling (the llama3-* presets carry
llama3 x 8 / x 32 over 8,192) at 2,048 tokens was trusted with 262,144 positions, so longer prompts ran without
--allow-extrapolation. A record is the reach already (its start's reach included); only Hugging Face lengths are
stretched (vLLM's rule). The rest pins what no other test held."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from longctx.checkpoint.manifest import write_manifest  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402
from longctx.config.positions import model_reach  # noqa: E402
from longctx.generate.loading import load_model  # noqa: E402
from longctx.models.hf import load_hf  # noqa: E402
from longctx.models.kv_cache import KVCache  # noqa: E402
from longctx.models.llama import rope_cos_sin  # noqa: E402
from longctx.models.static_decode import CompiledStep, install  # noqa: E402
from longctx.train.trainer import Trainer  # noqa: E402

ORIGINAL, VOCAB, TOL = 64, 128, 2e-5  # logits of order 3: 2e-5 is a few fp32 ulps of summed error
ROPES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),  # beta 32 / 1, truncate
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, mscale=1.0,
                        mscale_all_dim=0.5, beta_fast=16.0, beta_slow=2.0, truncate=False),
    "yarn-attention-factor": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                                  attention_factor=0.8),
}


def _hf_config(scaling, theta=10000.0, vocab=VOCAB, dim=64, ffn=128, layers=2) -> dict:
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=dim, intermediate_size=ffn,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
                torch_dtype="float32", initializer_range=0.1, rope_theta=theta,
                rope_scaling=dict(scaling) if scaling else None)  # (a copy: transformers adds rope_theta to it)


def _hf_dir(tmp_path, scaling):
    """A random tiny Llama made by transformers, saved as an hf:DIR; (dir, the transformers model)."""
    config = _hf_config(scaling)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).float().eval()
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(d / "model.safetensors"))
    return d, ref


def _tokens(n=240, rows=2, seed=1, vocab=VOCAB):
    return torch.randint(0, vocab, (rows, n), generator=torch.Generator().manual_seed(seed))


def _err(ours, theirs) -> float:
    return (ours.double() - theirs.double()).abs().max().item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "static-step"])
@pytest.mark.parametrize("rope", list(ROPES))
def test_cached_decode_past_the_original_length_matches_transformers(tmp_path, rope, compiled):
    d, ref = _hf_dir(tmp_path, ROPES[rope])
    ours = load_hf(d).eval()
    t = _tokens()
    with torch.no_grad():
        want = ref(t).logits
        cache = KVCache.for_model(ours, t.shape[0], 256)
        if compiled:  # (the eager backend: the static-shape graph without compiling it)
            assert install(cache, ours, CompiledStep(backend="eager"))
        got = [ours(t[:, :40], cache=cache), ours(t[:, 40:100], cache=cache)]  # the prefill crosses 64
        got += [ours(t[:, i:i + 1], cache=cache) for i in range(100, t.shape[1])]
    assert _err(torch.cat(got, dim=1), want) <= TOL
    assert not compiled or cache.fast.calls == t.shape[1] - 100 + 2  # (both prefill chunks fit a bucket)
    assert _err(ours(t).detach(), want) <= TOL  # the full forward too
    # (the check can fail: a model that forgot the scaling past 64 is far off)
    plain = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**_hf_config(None))).float().eval()
    plain.load_state_dict(ref.state_dict())
    with torch.no_grad():
        assert _err(plain(t).logits, want) > 1e-2


def test_packed_documents_restart_their_scaled_positions(tmp_path):
    """One row holding a 150- and a 90-token document (positions 0..149, 0..89, document ids 0 and 1):
    each document's logits are transformers' on that document alone, both running past 64."""
    d, ref = _hf_dir(tmp_path, ROPES["yarn-mscale"])
    ours = load_hf(d).eval()
    a, b = _tokens(150, 1, seed=2), _tokens(90, 1, seed=3)
    tokens = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(150), torch.arange(90)])[None]
    doc_ids = torch.cat([torch.zeros(150, dtype=torch.long), torch.ones(90, dtype=torch.long)])[None]
    with torch.no_grad():
        packed = ours(tokens, positions, doc_ids)
        assert _err(packed[:, :150], ref(a).logits) <= TOL
        assert _err(packed[:, 150:], ref(b).logits) <= TOL
        # (the check can fail: without the document mask the second document sees the first). Positions
        # running on through the row (150..239) would give the same logits: under the mask only p_q - p_k
        # enters q.k, and every scaling here keeps that; so the restart is pinned through the mask.
        assert _err(ours(tokens, positions, None)[:, 150:], ref(b).logits) > 1e-2


def _rotate(x, angles):
    """x [..., d] turned by `angles` [d / 2] in float64, rotate-half pairs (j, j + d / 2)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.exp(1j * angles.double())
    return torch.cat([z.real, z.imag], dim=-1)


def test_ms_poe_on_a_yarn_model_turns_by_yarns_frequencies_at_p_over_r(tmp_path):
    """Ms-PoE's per-kv-head positions p / r with yarn's scaled frequencies and its attention factor on
    both q and k (transformers' inv_freq and attention factor, rotated in float64); and its cached decode
    past the original length equals its full forward."""
    d, _ = _hf_dir(tmp_path, ROPES["yarn-mscale"])
    plain = load_hf(d).eval()
    cfg = dataclasses.replace(plain.cfg, rope_ms_poe=True, rope_ms_poe_order="index", rope_ms_poe_min=1.25,
                              rope_ms_poe_max=2.5, rope_ms_poe_skip_layers=1)
    model = load_model(load_config(overrides={"model": {**_fields(cfg), "init_from": f"hf:{d}"},
                                              "train": {"seq_len": 256}}), "cpu", torch.float32)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.AutoConfig.for_model(**_hf_config(
        ROPES["yarn-mscale"])), "cpu")
    assert model.rope_scale == pytest.approx(factor, rel=1e-12) and factor != 1.0
    s, hd = 12, model.cfg.resolved_head_dim
    positions = torch.arange(200, 200 + s)[None]
    x = torch.randn(1, s, model.cfg.dim, generator=torch.Generator().manual_seed(4))
    att = model.layers[1].attention
    with torch.no_grad():
        q, k, _ = att.qkv(x, *model.layer_rope(1, positions, None))
        raw_q, raw_k = att.wq(x).view(1, s, 4, hd), att.wk(x).view(1, s, 2, hd)
    for g, r in enumerate((1.25, 2.5)):  # kv head g, its query heads 2g and 2g + 1
        angles = (positions[0].double() / r)[:, None] * inv_freq.double()
        torch.testing.assert_close(k[0, :, g].double(), factor * _rotate(raw_k[0, :, g], angles), atol=2e-5, rtol=0)
        for h in (2 * g, 2 * g + 1):
            torch.testing.assert_close(q[0, :, h].double(), factor * _rotate(raw_q[0, :, h], angles),
                                       atol=2e-5, rtol=0)
    t = _tokens(160)
    with torch.no_grad():
        full = model(t)
        cache = KVCache.for_model(model, t.shape[0], 192)
        got = [model(t[:, :70], cache=cache)] + [model(t[:, i:i + 1], cache=cache) for i in range(70, 160)]
    assert _err(torch.cat(got, dim=1), full) <= TOL


def _fields(cfg) -> dict:
    """The extension keys of a ModelConfig, as [model] overrides."""
    return {k: v for k, v in vars(cfg).items() if k.startswith("rope_") or k == "max_seq_len"}


# ----------------------------------------------------------------------------------------------
# a staged run, an extension run from its checkpoint, a resume, generation loads


_MAP = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj",
        "tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def _transformers_twin(model, theta, scaling):
    """transformers' Llama with the RoPE settings given (not read from `model`) and `model`'s weights."""
    c = model.cfg
    ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        **_hf_config(scaling, theta, c.vocab_size, c.dim, c.ffn_dim, c.layers))).float().eval()
    state = {}
    for name, value in model.state_dict().items():
        module, leaf = name.rsplit(".", 1)
        if module.startswith("layers."):
            _, i, rest = module.split(".", 2)
            state[f"model.layers.{i}.{_MAP[rest]}.{leaf}"] = value
        else:
            state[f"{_MAP[module]}.{leaf}"] = value
    ref.load_state_dict(state, strict=True)
    return ref


def _matches(model, theta, scaling) -> float:
    t = _tokens(240, 1, seed=5, vocab=256)
    model.eval()
    with torch.no_grad():
        return _err(model(t), _transformers_twin(model, theta, scaling)(t).logits)


_RUN = ["--train.warmup_steps=1", "--train.eval_interval=0", "--data.max_docs=60", "--metrics.progress=false",
        "--metrics.plots=false", "--model.layers=2", "--model.dim=64", "--model.ffn_dim=128", "--train.global_batch=2",
        "--train.lr=1e-2", "--checkpoint.interval=2", "--data.tokenizer=byte"]
_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)


def _quiet(*_args, **_kwargs):
    pass


def test_extension_run_resume_and_generation_compute_with_the_final_rope(tmp_path):
    """Stage 1 trains at 32 then 64 tokens (default RoPE); the extension run starts from its checkpoint
    with yarn 4x over 64 and rope_theta 20000, through stages of 64 then 128 tokens, is resumed in its
    second stage, and its checkpoint is loaded for generation as saved and with other extension keys. Each
    model's logits over 240 tokens are transformers' with the final settings, on the same weights."""
    first = Trainer(load_config(overrides=_RUN + [f"--train.run_dir={tmp_path}/a", "--train.stages=32:2,64:2"]),
                    log=_quiet)
    first.run()
    assert _matches(first.model, 10000.0, None) <= TOL
    ext = _RUN + [f"--train.run_dir={tmp_path}/b", f"--model.init_from={tmp_path}/a/checkpoints",
                  "--train.stages=64:1,128:3", "--model.rope_scaling=yarn", "--model.rope_factor=4",
                  f"--model.rope_original_max_len={ORIGINAL}", "--model.rope_theta=20000"]
    run = Trainer(load_config(overrides=ext), log=_quiet)
    assert _matches(run.model, 20000.0, _YARN) <= TOL  # the start: the loaded weights with the extension
    assert _matches(run.model, 10000.0, None) > 50 * TOL  # (not the checkpoint's own RoPE; small trained logits)
    run.run()
    assert _matches(run.model, 20000.0, _YARN) <= TOL
    final = run.model.state_dict()
    checkpoints = tmp_path / "b" / "checkpoints"
    steps = sorted(p.name for p in checkpoints.glob("step-*"))
    assert len(steps) == 2  # steps 2 (in stage 2) and 4
    resumed = Trainer(load_config(overrides=ext + [f"--checkpoint.resume={checkpoints / steps[0]}"]), log=_quiet)
    assert resumed.start_step == 2 and resumed.sampler.stage.index == 1
    assert _matches(resumed.model, 20000.0, _YARN) <= TOL
    # the guard: the first run trained on 64; the extension's start reaches 64 x 4 and its record holds that
    assert model_reach(load_config(overrides=[f"--model.init_from={tmp_path}/a/checkpoints"]).model).positions == 64
    assert model_reach(load_config(overrides=[f"--model.init_from={checkpoints}"]).model).positions == 4 * ORIGINAL
    for loads, theta, scaling in [
        ([], 20000.0, _YARN),
        (["--model.rope_scaling=llama3", "--model.rope_factor=4", f"--model.rope_original_max_len={ORIGINAL}"],
         20000.0, ROPES["llama3"]),
        (["--model.rope_scaling=linear", "--model.rope_factor=2", "--model.rope_theta=50000"], 50000.0,
         dict(rope_type="linear", factor=2.0)),
        (["--model.rope_scaling=none"], 20000.0, None),
    ]:
        model = load_model(load_config(overrides=[f"--model.init_from={checkpoints}", *loads]), "cpu", torch.float32)
        assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items())  # the last step's weights
        assert _matches(model, theta, scaling) <= TOL, loads


def test_bf16_rotates_with_fp32_tables_and_rounds_once(tmp_path):
    """A bf16 generation load keeps transformers' fp32 inv_freq (model.to(bf16) would round it) and rotates
    bf16 q / k with fp32 cos and sin, rounding the result once: equal to the float64 rotation rounded to
    bf16 up to one bf16 step. transformers instead casts cos and sin to bf16 and rotates in bf16 (its
    LlamaRotaryEmbedding returns cos.to(x.dtype)): several steps off the float64 rotation."""
    d, _ = _hf_dir(tmp_path, ROPES["yarn"])
    model = load_model(load_config(overrides=[f"--model.init_from=hf:{d}", "--train.seq_len=256"]), "cpu",
                       torch.bfloat16)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.AutoConfig.for_model(**_hf_config(ROPES["yarn"])),
                                                   "cpu")
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, inv_freq)
    positions = torch.arange(150, 250)[None]
    x = torch.randn(1, 100, model.cfg.dim, generator=torch.Generator().manual_seed(6)).bfloat16()
    att = model.layers[0].attention
    with torch.no_grad():
        cos, sin = rope_cos_sin(positions, model.inv_freq, model.rope_scale)  # (what hidden_states passes)
        q, _, _ = att.qkv(x, cos, sin)
        raw = att.wq(x).view(1, 100, 4, -1)
    assert cos.dtype == torch.float32
    assert q.dtype == torch.bfloat16
    exact = factor * _rotate(raw, (positions[0].double()[:, None] * inv_freq.double())[:, None, :])
    step = exact.abs().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step (8 significant bits)
    assert ((q.double() - exact).abs() / step).max() <= 1.0


def _sharded_rank(d: str, prompt: list, more: list) -> list:
    """One rank of a ctx = 2 generation (generate/sharded.py): the prompt prefilled in training's zigzag
    layout, then decoded one token at a time on the sharded cache; the last logits of each call."""
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime

    cfg = load_config(overrides=["--parallel.ctx=2", "--model.layers=2"])
    rt = Runtime.create(cfg, torch.distributed.get_rank(), 2, "cpu")
    backend, model = ShardedGeneration(rt.mesh, rt.world_mesh), load_hf(d).eval()
    with torch.inference_mode():
        cache = backend.cache(model, 1, len(prompt) + len(more) + 8)
        out = [backend.prefill(model, cache, torch.tensor([prompt]), 4096)[0]]
        out += [model(torch.tensor([[t]]), cache=cache)[0, -1].float() for t in more]
    return torch.stack(out).double().numpy()  # (not a tensor: its shared storage may outlive the rank)


@pytest.mark.slow
def test_ctx_sharded_prefill_and_decode_use_the_scaled_tables(tmp_path):
    """A yarn model's prompt of 100 tokens prefilled over 2 context ranks (each holding zigzag pieces: its
    RoPE positions are the global ones it holds), then 40 tokens decoded on the sharded cache: every step's
    logits are transformers' full forward's at that position, on both ranks."""
    from longctx.job.spawn import run_spawned

    d, ref = _hf_dir(tmp_path, ROPES["yarn-mscale"])
    t = _tokens(140, 1, seed=7)[0].tolist()
    with torch.no_grad():
        want = ref(torch.tensor([t])).logits[0, 99:]
    for got in run_spawned(2, _sharded_rank, str(d), t[:100], t[100:]):
        assert _err(torch.from_numpy(got), want) <= TOL


@pytest.mark.parametrize("preset, scaling, stretched", [("llama3-1b", {}, 8192 * 32),
                                                        ("debug", {"rope_scaling": "yarn", "rope_factor": 4.0}, 32768)])
def test_a_run_trained_under_a_scaling_from_scratch_reaches_what_it_trained_on(tmp_path, preset, scaling, stretched):
    """A checkpoint (weightless: the guard reads the manifest) of a from-scratch run under the llama3-1b preset's
    llama3 x 32 over 8,192 (or yarn x 4 over the default 8,192) that trained on 2,048 positions: its reach is
    2,048, not original x factor; a scaling changed at generation stretches it from an original of 2,048
    (original x factor), not from the default 8,192, past what the weights learned (nothing)."""
    cfg = load_config(None, {"model": {"preset": preset, "layers": 1, **scaling}, "train": {"seq_len": 2048}})
    step = tmp_path / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    write_manifest(step, step=2, layout={}, model=to_dict(cfg)["model"], tokenizer="byte", trained_positions=2048)
    reach = model_reach(load_config(None, {"model": {"init_from": str(step)}, "train": {"seq_len": 2048}}).model)
    assert (reach.positions, reach.trained, reach.scaled) == (2048, 2048, False), stretched  # (was `stretched`)
    for original, reaches in ((2048, 4096), (8192, 2048)):
        wider = load_config(None, {"model": {"init_from": str(step), "rope_scaling": "yarn", "rope_factor": 2.0,
                                             "rope_original_max_len": original}, "train": {"seq_len": 2048}}).model
        assert model_reach(wider).positions == reaches, original
