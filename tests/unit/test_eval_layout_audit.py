"""`longctx eval`'s layout, decided before any rank starts: --mode generate under an odd --nproc runs on the
ctx ranks its default gives (not the data parallelism it then refused), and Ms-PoE's attention order, which
ranks the heads through the whole weights, is refused in the launcher for score mode's sharded model (it was
refused by every rank once each had started and built its model)."""

import sysconfig
from pathlib import Path

import pytest

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.eval.request import prepare
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TINY = ["--model.preset=debug", "--model.layers=2", "--model.dim=32", "--model.heads=4", "--model.kv_heads=2",
        "--model.ffn_dim=64"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layout")
    hf = save_hf(build_model(load_config(overrides=TINY).model, seed=3), tmp / "hf")
    text = tmp / "long.py"
    text.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text())
    return hf, text


def _prepare(folder, nproc: int, *extra):
    hf, text = folder
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--data", str(text), "--samples", "1", *extra])
    return prepare(args, rest, nproc)


@pytest.mark.parametrize("nproc", [3, 5])
def test_generate_under_an_odd_nproc_shards_the_cache_over_ctx_ranks(folder, nproc):
    request = _prepare(folder, nproc, "--task", "passkey", "--mode", "generate", "--lengths", "301",
                       "--depths", "0.5")
    p = request.cfg.parallel
    assert (p.head, p.ctx, request.batch) == (1, nproc, 1)


def test_score_mode_under_an_odd_nproc_stays_data_parallel(folder):
    request = _prepare(folder, 3, "--task", "ppl", "--lengths", "64")
    assert (request.cfg.parallel.ctx, request.batch) == (1, 3)


MS_POE = ["--model.rope_ms_poe=true", "--model.rope_ms_poe_skip_layers=0"]


@pytest.mark.parametrize("nproc, extra", [(4, []), (2, ["--parallel.ctx=2"]), (1, ["--memory.model_states=host"])])
def test_ms_poe_attention_order_on_a_sharded_model_is_refused_before_any_rank(folder, nproc, extra):
    with pytest.raises(ConfigError, match="rope_ms_poe_order=index"):
        _prepare(folder, nproc, "--task", "ppl", "--lengths", "64", *MS_POE, *extra)


def test_ms_poe_runs_where_the_weights_are_whole(folder):
    for nproc, extra in ((1, ["--model.rope_ms_poe_order=attention"]), (4, ["--model.rope_ms_poe_order=index"])):
        assert _prepare(folder, nproc, "--task", "ppl", "--lengths", "64", *MS_POE, *extra).cfg.model.rope_ms_poe
    generate = _prepare(folder, 4, "--task", "passkey", "--mode", "generate", "--lengths", "301", "--depths", "0.5",
                        *MS_POE)
    assert generate.cfg.parallel.head * generate.cfg.parallel.ctx == 4


@pytest.mark.parametrize("nproc", [3, 5])
def test_longctx_generate_under_an_odd_nproc_shards_the_cache_over_ctx_ranks(folder, tmp_path, nproc):
    """`longctx generate --nproc 3` with no layout: its own default (data parallelism) was refused."""
    from longctx.generate.cli import prepare as prepare_generate

    hf, _ = folder
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    args, rest = build_parser("generate").parse_known_args(
        ["generate", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--prompts", str(prompts),
         "--max-new-tokens", "4", "--nproc", str(nproc)])
    p = prepare_generate(args, rest).cfg.parallel
    assert (p.head, p.ctx) == (1, nproc)
