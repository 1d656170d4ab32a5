"""Ms-PoE (models/ms_poe.py, model.rope_ms_poe): per-kv-head RoPE positions p / r, plain RoPE when
off or at ratio 1, cached decode equal to a full forward, bad settings and training refused."""

import dataclasses
import json
import math
import re

import pytest
import torch

from longctx.cli import main
from longctx.config import ModelConfig, load_config
from longctx.errors import ConfigError
from longctx.models.kv_cache import KVCache
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep, install

CFG = ModelConfig(layers=4, heads=4, kv_heads=2)  # the debug shape: 2 query heads per kv head


def _model(**fields):
    return build_model(dataclasses.replace(CFG, **fields), seed=0).eval()


def _tokens(n=48, rows=2, seed=1):
    return torch.randint(0, CFG.vocab_size, (rows, n), generator=torch.Generator().manual_seed(seed))


def _rotate(x: torch.Tensor, position: float, theta: float) -> torch.Tensor:
    """An independent RoPE in complex form: dims (j, j + d/2) are one complex number turned by
    position x theta^(-2j/d) ("rotate half", the Hugging Face layout). x [d] -> [d]."""
    d = x.shape[-1]
    angle = position * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[: d // 2].double(), x[d // 2:].double()) * torch.exp(1j * angle)
    return torch.cat([z.real, z.imag]).float()


def test_ratio_one_is_plain_rope_bit_for_bit():
    plain = _model()
    unit = _model(rope_ms_poe=True, rope_ms_poe_min=1.0, rope_ms_poe_max=1.0, rope_ms_poe_skip_layers=0)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(plain(tokens), unit(tokens))
    assert plain.ms_poe_ratios is None  # off: no per-head tables at all
    rope = (torch.zeros(1), torch.zeros(1))
    assert plain.layer_rope(3, tokens, rope) is rope


def test_each_head_turns_by_its_kv_heads_ratio():
    """q and k of a Ms-PoE layer equal the reference rotation at p / r, r spaced by kv head index
    (order=index) from min to max; a kv head's query heads share its ratio; skipped layers are plain."""
    model = _model(rope_ms_poe=True, rope_ms_poe_order="index", rope_ms_poe_min=1.25, rope_ms_poe_max=2.5)
    expected = [1.25, 2.5]  # kv head 0, 1
    b, s, d = 1, 12, CFG.resolved_head_dim
    x = torch.randn(b, s, CFG.dim, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(100, 100 + s)[None]
    plain = model.layer_rope(0, positions, None)
    assert plain is None  # layers 0, 1 keep plain RoPE (skip_layers = 2)
    attention = model.layers[2].attention
    with torch.no_grad():
        q, k, _ = attention.qkv(x, *model.layer_rope(2, positions, None))
        raw_q = attention.wq(x).view(b, s, CFG.heads, d)
        raw_k = attention.wk(x).view(b, s, CFG.kv_heads, d)
    for t in range(s):
        p = float(positions[0, t])
        for h in range(CFG.heads):
            r = expected[h // 2]  # heads 0, 1 -> kv head 0; heads 2, 3 -> kv head 1
            torch.testing.assert_close(q[0, t, h], _rotate(raw_q[0, t, h], p / r, CFG.rope_theta), atol=2e-5, rtol=0)
        for g in range(CFG.kv_heads):
            torch.testing.assert_close(k[0, t, g], _rotate(raw_k[0, t, g], p / expected[g], CFG.rope_theta),
                                       atol=2e-5, rtol=0)
    # the two kv groups really differ: the ratio is per group, not one for all
    assert not torch.allclose(_rotate(raw_q[0, -1, 0], 111 / 1.25, CFG.rope_theta),
                              _rotate(raw_q[0, -1, 0], 111 / 2.5, CFG.rope_theta), atol=1e-3)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cached_decode_equals_the_full_forward(compiled):
    """Keys are cached rotated at p / r and new queries turn by p / r too: a prefill in chunks then
    token-by-token decode (eager, or every call through the static decode step) gives the full
    forward's logits."""
    model = _model(rope_ms_poe=True)
    tokens = _tokens(40)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache.for_model(model, tokens.shape[0], 64)
        if compiled:
            assert install(cache, model, CompiledStep(backend="eager"))
        got = [model(tokens[:, :16], cache=cache), model(tokens[:, 16:30], cache=cache)]
        got += [model(tokens[:, i:i + 1], cache=cache) for i in range(30, 40)]
        torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-5, rtol=1e-5)
        assert not compiled or cache.fast.calls == 12
        assert (_model()(tokens) - full).abs().max() > 1e-3  # (Ms-PoE did change the model)


def test_attention_order_gives_the_unpicky_head_the_largest_ratio():
    """A kv head whose keys are all zero attends uniformly (no outlier weights: the least position-
    aware): it gets rope_ms_poe_max, the other kv head (keys scaled up: peaked attention) rope_ms_poe_min;
    recomputed on the same weights the ratios are the same."""
    model = _model(rope_ms_poe=True)
    d = CFG.resolved_head_dim
    for zeroed, layer in ((0, 2), (1, 3)):
        wk = model.layers[layer].attention.wk.weight
        with torch.no_grad():
            wk[zeroed * d:(zeroed + 1) * d] = 0
            wk[(1 - zeroed) * d:(2 - zeroed) * d] *= 200
    model.init_rope()
    assert model.ms_poe_ratios[:2].eq(1).all()
    torch.testing.assert_close(model.ms_poe_ratios[2:], torch.tensor([[1.8, 1.2], [1.2, 1.8]]))
    before = model.ms_poe_ratios.clone()
    model.init_rope()
    assert torch.equal(model.ms_poe_ratios, before)


@pytest.mark.parametrize("fields, said", [
    (dict(rope_ms_poe_min=1.8, rope_ms_poe_max=1.2), "rope_ms_poe_min <= model.rope_ms_poe_max"),
    (dict(rope_ms_poe_min=0.5), "1 <= model.rope_ms_poe_min"),
    (dict(rope_ms_poe_skip_layers=4), "rope_ms_poe_skip_layers must be in [0, model.layers = 4)"),
])
def test_bad_settings_are_one_clear_error(fields, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        build_model(dataclasses.replace(CFG, rope_ms_poe=True, **fields), device="meta")
    build_model(dataclasses.replace(CFG, **fields), device="meta")  # (ignored while Ms-PoE is off)


def test_training_refuses_it(capsys):
    assert main(["train", "--model.rope_ms_poe=true", "--train.steps=1"]) != 0
    err = capsys.readouterr().err
    assert "model.rope_ms_poe is a position option for longctx generate and longctx eval" in err
    model = _model(rope_ms_poe=True).train()
    with pytest.raises(ConfigError, match="longctx train does not train with it"):
        model(_tokens(8))


def test_overrides_reach_a_loaded_models_config(tmp_path):
    """--model.rope_ms_poe* on a Hugging Face directory (generate's and eval's --model.* path): extension
    keys, kept, not refused as contradicting the weights nor dropped."""
    test_hf = pytest.importorskip("test_hf")
    (tmp_path / "config.json").write_text(json.dumps(test_hf.hf_config("llama")))
    cfg = load_config(None, {"model": {"init_from": f"hf:{tmp_path}", "rope_ms_poe": True, "rope_ms_poe_max": 2.0,
                                       "rope_ms_poe_order": "index", "rope_ms_poe_skip_layers": 1},
                             "train": {"seq_len": 2, "eval_interval": 0}})
    m = cfg.model
    assert (m.rope_ms_poe, m.rope_ms_poe_min, m.rope_ms_poe_max, m.rope_ms_poe_order) == (True, 1.2, 2.0, "index")
    assert math.isclose(m.rope_theta, 10000.0)
