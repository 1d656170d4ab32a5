"""A randomized audit of the config and its command line (round 116): every key of the schema (walked from
config.SECTIONS, never listed), seeded draws of valid values (edges at the documented ranges, the examples its
help text quotes, random numbers and strings with quotes, commas, backslashes and unicode), each checked four ways:
to_toml -> load gives the same Config; `longctx train`'s own parser and config step (and `--print-config`'s TOML)
give the same value for `--section.key value` and `--section.key=value`; a value of the wrong type or past its
documented range is one ConfigError naming the key; and a resume lists exactly the keys that changed (resume's
own comparison, config/resume.py). A value is drawn in the smallest config that makes it apply (CONTEXTS: a MoE
key needs a MoE model, a draft key a draft.target, ...), since inert_options.py refuses it elsewhere."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import re

import pytest
import tomllib

from longctx.cli import build_parser, main
from longctx.config import SECTIONS, build_config, fields_by_key, load_config, to_dict, to_toml
from longctx.config.fields import toml_value
from longctx.config.inert_options import inert_option_notes
from longctx.config.layout import resolve_layout
from longctx.config.moe_rules import moe_notes
from longctx.config.resume import NOT_SETTINGS, _differences, load_run_config
from longctx.config.tokenizer import tokenizer_file
from longctx.errors import ConfigError, UserError

SEED = 116
DRAWS = 3  # random values per key, beside its range's edges and its help text's examples
KEYS = [(section, key, f) for section, cls in SECTIONS.items() for key, f in fields_by_key(cls).items()]
PARSER = build_parser("train")

# The documented ranges (schema help texts and the rules' messages), as intervals: '(0,' is > 0, '[0,1)' is
# 0 <= x < 1. A key marked ~ has its inside edge refused by a rule of other keys (dim 1 and 4 heads), so only
# the outside is asked.
RANGES_TEXT = """
(0,       ~model.dim model.layers ~model.heads model.kv_heads model.ffn_dim model.vocab_size ~model.max_seq_len
          model.norm_eps model.rope_theta model.init_std model.rope_original_max_len model.moe.route_scale
          model.moe.dts_temperature parallel.timeout_s train.steps train.global_batch train.grad_accum train.lr
          train.eps train.eval_batches train.co2_outer_lr metrics.log_interval draft.kd_temperature
[0,       model.head_dim model.moe.experts model.moe.expert_dim model.moe.shared_experts model.moe.shared_dim
          model.moe.dts_steps model.moe.sinkhorn_iters model.moe.capacity_factor model.moe.aux_loss model.moe.z_loss
          model.moe.bias_update_rate model.rope_mscale model.rope_mscale_all_dim model.rope_attention_factor
          parallel.window parallel.expert_pipeline_chunks parallel.expert_replicas parallel.grad_bucket_blocks
          train.warmup_steps train.weight_decay train.grad_clip train.eval_interval train.skip_limit
          train.co2_momentum_clip train.co2_staleness_penalty train.co2_sync_steps data.max_docs
          memory.offload_skip_last memory.block_chunk memory.attention_chunk memory.expert_chunk memory.loss_chunk
          checkpoint.interval checkpoint.exit_after_minutes metrics.peak_tflops metrics.profile_step draft.vocab
[1,       model.rope_factor model.moe.top_k model.moe.groups parallel.expert parallel.expert_placement_window
          parallel.zero_pp_block train.spike_window train.co2_local_steps data.workers checkpoint.keep draft.layers
          draft.block
[2,       train.seq_len
[0,1]     train.min_lr_ratio memory.offload_fraction
(0,1]     train.lr_decay_fraction
[0,1)     train.beta1 train.beta2 train.co2_outer_momentum data.eval_fraction
[0,9223372036854775807]  train.seed
"""
RANGES = {name.lstrip("~"): (m.group(1), m.group(2), m.group(3), m.group(4), name.startswith("~"))
          for block in re.split(r"\n(?=\S)", RANGES_TEXT.strip())
          for m in [re.match(r"([\[(])([-\d.]+),([-\d.]*)([\])]?)", block)] for name in block.split()[1:]}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny Hugging Face model directory (config.json alone): what draft.target and model.init_from read."""
    path = tmp_path_factory.mktemp("hf")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    return f"hf:{path}"


def contexts(hf: str) -> list[dict]:
    """The configs a drawn value is tried in, plainest first: the first that takes it is its context."""
    moe = {"preset": "debug-moe"}
    return [{}, {"model": moe}, {"model": {**moe, "moe.router": "sigmoid"}}, {"model": {**moe, "moe.router": "dts"}},
            {"model": {"rope_scaling": "yarn"}}, {"model": {"rope_scaling": "llama3"}},
            {"train": {"data_parallel": "co2"}, "parallel": {"dp_replicate": 2}},
            {"memory": {"recompute": "selective"}}, {"memory": {"attention_chunk": 64}},
            {"parallel": {"zero_pp": "hpz"}}, {"parallel": {"expert": 2, "expert_replicas": 1}, "model": moe},
            {"data": {"path": "stores/a,stores/b"}}, {"train": {"eval_interval": 0}}, {"parallel": {"ctx": 4}},
            {"model": {"qkv_bias": True, "out_bias": True}}, {"model": {"family": "qwen3", "qk_norm": True}},
            {"parallel": {"expert": 2}, "model": moe},
            {"draft": {"target": hf}}, {"draft": {"target": hf, "loss": "kd"}}]


def _base(f) -> str:
    return f.type.split("|")[0].strip()


def _edges(name: str, kind: str) -> tuple[list, list, bool]:
    """(inside edges, outside values, whether the inside edges stand alone) of a key's documented range."""
    if name not in RANGES:
        return [], [], False
    left, lo, hi, right, tied = RANGES[name]
    num = int if kind == "int" else float
    step = (lambda x, d: x + d) if kind == "int" else (lambda x, d: math.nextafter(x, x + d))
    inside, outside = [], []
    lo = num(lo)
    inside.append(lo if left == "[" else step(lo, 1))
    outside += [step(lo, -1)] + ([lo] if left == "(" else [])
    if hi:
        hi = num(hi)
        inside.append(hi if right == "]" else step(hi, -1))
        outside += [step(hi, 1)] + ([hi] if right == ")" else [])
    return inside, outside, not tied


def _help_examples(f) -> list[str]:
    """The values a key's help text quotes: "0,1", 'auto', "passkey:0.2", ..."""
    return [a or b for a, b in re.findall(r'"([^"]*)"|\'([^\']*)\'', f.metadata["help"])]


def draws(section: str, key: str, f, hf: str) -> list:
    """Seeded candidate values of one key (some invalid: the config decides which it takes)."""
    rng = random.Random(f"{SEED}:{section}.{key}")
    kind, name = _base(f), f"{section}.{key}"
    if kind == "bool":
        return [True, False]
    if f.metadata.get("choices"):
        return list(f.metadata["choices"])
    inside, _, _ = _edges(name, kind)
    if kind == "int":
        return [*inside, f.default, rng.randint(0, 8), rng.choice([2, 4]), rng.choice([8, 16]),
                *(rng.choice([2 ** rng.randint(0, 20), rng.randint(-2, 10**6)]) for _ in range(DRAWS))]
    if kind == "float":
        literals = [1e-06, 3e-4, 2e-5, 0.1, 0.30000000000000004, 1e16, 7.0]
        return [*inside, f.default, *f.metadata.get("words", ()), round(rng.uniform(0, 10), 2),
                *(rng.choice([10 ** rng.uniform(-8, 4), round(rng.random(), 3), rng.choice(literals)])
                  for _ in range(DRAWS))]
    alphabet = "ab Z09é日😀,'\"\\-_:=#[]./\t"
    numbers = ",".join(str(round(rng.random(), 2)) for _ in range(2))
    words = ("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(DRAWS))
    return [f.default, *_help_examples(f), hf, numbers, *words]


def _with(ctx: dict, section: str, key: str, value) -> dict:
    raw = {s: dict(v) for s, v in ctx.items()}
    raw.setdefault(section, {})[key] = value
    return raw


_ACCEPTED: dict = {}


def accepted(section: str, key: str, f, hf: str) -> list[tuple[dict, object, object]]:
    """(context, value, Config) of each draw some context takes: the first that reads the key (no note says it is
    ignored), else the first that takes it (worked out once per key)."""
    if (section, key, hf) in _ACCEPTED:
        return _ACCEPTED[section, key, hf]
    out = _ACCEPTED[section, key, hf] = []
    for value in dict.fromkeys(draws(section, key, f, hf)):  # (order kept, repeats dropped; 0 == 0.0 == False aside)
        taken = []
        for ctx in contexts(hf):
            try:
                taken.append((ctx, value, build_config(_with(ctx, section, key, value))))
            except UserError:
                continue
            if f"{section}.{key}" not in _notes(taken[-1][2]):  # (a context that reads it: its rules apply)
                taken = taken[-1:]
                break
        out += taken[:1]
    return out


def _notes(cfg) -> str:
    """What a run says of the keys it takes but ignores (train/run_lines.py)."""
    return " ".join(inert_option_notes(cfg) + moe_notes(cfg.model))


def spelled(value) -> str:
    """A value as a user types it after --section.key."""
    return value if isinstance(value, str) else toml_value(value)


def flags(ctx: dict) -> list[str]:
    return [f"--{s}.{k}={spelled(v)}" for s, values in ctx.items() for k, v in values.items()]


def _cli(args: list[str]):
    """`longctx train`'s parser and config step (config/layout.py), on one process, without training."""
    parsed, rest = PARSER.parse_known_args(["train", *args])
    assert parsed.command == "train"
    return resolve_layout(parsed.config, rest, 1).cfg


def _printed(args: list[str]) -> dict:
    """What `longctx train --print-config` prints, read by a TOML reader, its sub-tables flattened."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["train", "--print-config", "--nproc", "1", *args]) == 0, err.getvalue()
    return {s: _flat(values) for s, values in tomllib.loads(out.getvalue()).items()}


def _flat(table: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in table.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _same(a, b) -> bool:
    return a == b and type(a) is type(b)


def _expected(section: str, key: str, f, value, init_from: str = ""):
    """The value a Config must hold for `value` given: a float key's whole number as a float; data.path's stores
    stripped and joined by commas (config/data_mix.py normal_path); data.tokenizer auto, the tokenizer it names."""
    if _base(f) == "float" and not isinstance(value, str):
        return float(value)
    if (section, key) == ("data", "path"):
        return ",".join(p.strip() for p in value.split(",") if p.strip())
    if (section, key) == ("data", "tokenizer") and value != "byte":  # (config/tokenizer.py resolve_tokenizer)
        return str(tokenizer_file(value).resolve()) if value != "auto" else "auto" if init_from else "byte"
    return value


def test_every_key_takes_values_that_survive_toml_and_hold_what_was_given(hf, tmp_path):
    short = []
    for section, key, f in KEYS:
        taken = accepted(section, key, f, hf)
        if len({repr(v) for _, v, _ in taken}) < 2 and (section, key) not in NOT_SETTINGS:
            short.append(f"{section}.{key}")
        for ctx, value, cfg in taken:
            got = getattr(getattr(cfg, section), f.name)
            assert _same(got, _expected(section, key, f, value, cfg.model.init_from)), (section, key, value, got, ctx)
            path = tmp_path / "c.toml"
            path.write_text(to_toml(cfg), encoding="utf-8")
            assert load_config(path) == cfg, (section, key, value, ctx)
    assert not short, f"keys no context takes two values of (add a context): {short}"


def test_documented_range_edges_are_taken_and_values_past_them_refused_naming_the_key(hf):
    assert set(RANGES) <= {f"{s}.{k}" for s, k, _ in KEYS}, "RANGES names a key the schema lacks"
    for section, key, f in KEYS:
        name = f"{section}.{key}"
        inside, outside, alone = _edges(name, _base(f))
        if not inside:
            continue
        homes = [ctx for ctx in contexts(hf) if _takes(ctx, section, key, inside[0])]
        assert homes or not alone, f"{name} = {inside[0]} (a documented edge) is refused in every context"
        for value in inside[1:] if alone else ():
            assert any(_takes(home, section, key, value) for home in homes), (name, value)
        for home in homes[:3] or [next(c for c in contexts(hf) if _takes(c, section, key, f.default))]:
            for value in outside:
                _refused_or_said_unread(home, section, key, value)


def _refused_or_said_unread(ctx: dict, section: str, key: str, value) -> None:
    """A value past its key's range: one error naming the key, by the TOML and the command line alike; or,
    where the run reads no such key (a yarn key under rope_scaling none), taken with the note that it is ignored."""
    name = f"{section}.{key}"
    try:
        cfg = build_config(_with(ctx, section, key, value))
    except UserError as e:  # (ConfigError; HFFormatError for a key the weights of model.init_from decide)
        assert name in str(e), (name, value, str(e))
        with pytest.raises(UserError, match=re.escape(name)):
            _cli([*flags(ctx), f"--{name}", spelled(value)])
        return
    assert name in _notes(cfg), f"{name} = {value!r}, past its documented range, was taken without a word ({ctx})"


def _takes(ctx: dict, section: str, key: str, value) -> bool:
    try:
        build_config(_with(ctx, section, key, value))
        return True
    except UserError:
        return False


def _cli_spellings(f, value, rng: random.Random) -> list[str]:
    if isinstance(value, bool):
        return [rng.choice(["true", "True", "1", "yes", "on", "TRUE"] if value else
                           ["false", "False", "0", "no", "off", "FALSE"])]
    if isinstance(value, float):
        return list(dict.fromkeys([toml_value(value), str(value), f"{value:.17g}"]))
    return [spelled(value)]


def _typed_on_cli(value) -> bool:
    """Whether the shell form can carry it: a value wrapped in quotes reaches longctx as a doubly quoted one,
    refused as such (override_hints.py quoted_problem)."""
    return not (isinstance(value, str) and len(value) > 1 and value[0] in "'\"" and value[-1] == value[0])


def test_the_command_line_gives_what_the_toml_gives(hf):
    rng = random.Random(SEED)
    for section, key, f in KEYS:
        printed = False
        for ctx, value, cfg in accepted(section, key, f, hf):
            if not _typed_on_cli(value):
                continue
            text = rng.choice(_cli_spellings(f, value, rng))
            # (a value that starts with -- reads as the next option after a space: `=` carries it)
            spaced = rng.random() < 0.5 and not text.startswith("--")
            form = [f"--{section}.{key}", text] if spaced else [f"--{section}.{key}={text}"]
            assert _cli([*flags(ctx), *form]) == cfg, (section, key, value, form, ctx)
            if not printed and not cfg.model.rope_ms_poe:  # (longctx train refuses Ms-PoE: generate and eval's)
                shown, expected, printed = _printed([*flags(ctx), *form]), to_dict(cfg), True
                assert all(_same(shown[s][k], v) for s in expected for k, v in expected[s].items()), (section, key)
            if section == "model" and key != "preset" and not ctx.get("model"):  # (a preset after the flag)
                _flag_over_preset(key, f, value)


def _flag_over_preset(key: str, f, value) -> None:
    """`--model.KEY v --model.preset P`: the flag is the user's, the preset fills only the keys not given."""
    for preset in ("small-100m", "debug-moe"):
        try:
            cfg = _cli([f"--model.{key}", spelled(value), "--model.preset", preset])
        except UserError:
            continue
        assert _same(getattr(cfg.model, f.name), _expected("model", key, f, value)), (key, value, preset)


WRONG_TOML = {"int": ["1.9", "2.0", "true", '"3"'], "float": ["true", '"0.5"', "[1.0]"],
              "bool": ["1", "0", '"false"', '"true"'], "str": ["1", "true", "1.5", "[]"]}
WRONG_CLI = {"int": ["1.9", "2.0", "1e3", "true", ""], "float": ["abc", "true", "", "1,5", "nan"],
             "bool": ["2", "truee", "", "-1"], "str": []}


def test_a_value_of_the_wrong_type_is_one_error_naming_the_key(hf, tmp_path):
    rng = random.Random(SEED)
    for section, key, f in KEYS:
        kind, name = _base(f), f"{section}.{key}"
        home = next(c for c in contexts(hf) if _takes(c, section, key, f.default))
        choices = f.metadata.get("choices")
        cli = rng.sample(WRONG_CLI[kind], min(2, len(WRONG_CLI[kind]))) + (["not-a-choice"] if choices else [])
        for text in rng.sample(WRONG_TOML[kind], 2):
            path = tmp_path / "c.toml"
            body = "".join(f"[{s}]\n" + "".join(f'"{k}" = {toml_value(v)}\n' for k, v in values.items())
                           for s, values in _with(home, section, key, "@").items())
            path.write_text(body.replace('"@"', text), encoding="utf-8")
            with pytest.raises(ConfigError, match=re.escape(name)):
                load_config(path)
        for text in cli:
            with pytest.raises(ConfigError, match=re.escape(name)):
                _cli([*flags(home), f"--{name}", text])


def _saved_run(tmp_path, ctx: dict, n: list) -> tuple:
    n.append(1)
    run = tmp_path / f"run{len(n)}"
    run.mkdir()
    cfg = build_config(_with(ctx, "train", "run_dir", str(run)))
    (run / "config.toml").write_text(to_toml(cfg), encoding="utf-8")
    return run, cfg


def _resume(run, *more: str):
    return load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto", *more], False)


def test_a_resume_lists_exactly_the_keys_that_changed(hf, tmp_path):
    runs, n, rng = {}, [], random.Random(SEED)
    for section, key, f in KEYS:
        if (section, key) in NOT_SETTINGS:
            continue
        name = f"{section}.{key}"
        for i, (ctx, value, cfg) in enumerate(accepted(section, key, f, hf)):
            if not _typed_on_cli(value) or i and rng.random() < 0.4:  # (every key's first value; 60% of the rest)
                continue
            if json.dumps(ctx) not in runs:
                runs[json.dumps(ctx)] = _saved_run(tmp_path, ctx, n)
            run, saved = runs[json.dumps(ctx)]
            before, after = to_dict(saved), to_dict(cfg)
            want = sorted(f"{s}.{k}" for s in after for k in after[s]
                          if not _same(before[s][k], after[s][k]) and (s, k) not in NOT_SETTINGS)
            diffs = _differences(before, after)
            assert sorted(f"{s}.{k}" for s, k, _, _ in diffs) == want, (name, value)
            try:
                resumed_cfg, resumed = _resume(run, "--checkpoint.allow_changes=true", f"--{name}={spelled(value)}")
            except UserError as e:  # (a change no resume may make: refused, naming the key or the weights' shapes)
                shapes = section == "model" and "would change the shapes of the model's weights" in str(e)
                assert want and (shapes or any(k in str(e) for k in want)), (name, value, str(e))
                continue
            now = to_dict(resumed_cfg)  # (the saved run's own keys stay, e.g. its resolved data.tokenizer)
            moved = sorted(f"{s}.{k}" for s in now for k in now[s]
                           if not _same(before[s][k], now[s][k]) and (s, k) not in NOT_SETTINGS)
            assert sorted({c.split(" ")[0] for c in resumed.changes}) == moved, (name, value, resumed.changes)
            assert _same(now[section][key], after[section][key]), (name, value)
            if rng.random() < 0.85:
                continue  # (a share of the values: each is a run directory written)
            again, same = _resume(_saved_run(tmp_path, _with(ctx, section, key, value), n)[0],
                                  f"--{name}={spelled(value)}")
            assert same.changes == [] and to_dict(again)[section][key] == to_dict(cfg)[section][key], (name, value)


def test_a_command_line_string_that_is_not_utf8_is_refused_naming_the_key(tmp_path):
    """`--train.run_dir $'caf\\xe9'` (a Latin-1 name: Python's argv holds the byte as a lone surrogate) was taken,
    and config.toml wrote it as an escape no TOML reader takes: the run's own config.toml, and so every resume of
    the run, failed with 'not valid TOML'. It is refused before any work, naming the key."""
    for key in ("train.run_dir", "data.corpus", "metrics.file", "checkpoint.dir"):
        with pytest.raises(ConfigError, match=rf"{re.escape(key)} = 'caf\\udce9' is not UTF-8 text \(byte 0xe9"):
            _cli([f"--{key}", "caf\udce9"])
    cfg = _cli(["--train.run_dir", "café"])  # (UTF-8 text, any script, is a path like another)
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    assert load_config(path).train.run_dir == "café"


def test_a_rope_scaling_key_over_weights_of_no_scaling_is_refused_or_said(hf, tmp_path):
    """`--model.init_from hf:DIR --model.rope_factor 4` over weights of plain RoPE trained plain RoPE: the factor,
    refused over a preset model (rope_scaling none reads none), was taken without a word over weights, as were
    the scalings' other keys (a note over a preset). The weights' own values are the baseline a key differs from."""
    # (a note, not a refusal, over weights: a saved config.toml of a run that took it before must still resume)
    notes = inert_option_notes(_cli(["--model.init_from", hf, "--model.rope_factor", "4"]))
    assert any("model.rope_factor = 4.0 is ignored: model.rope_scaling is none over the weights" in n for n in notes)
    saved = tmp_path / "config.toml"  # (as a run that took it wrote its config.toml: it loads, and says it)
    saved.write_text(to_toml(_cli(["--model.init_from", hf, "--model.rope_factor", "4"])))
    assert load_config(saved).model.rope_factor == 4.0
    cfg = _cli(["--model.init_from", hf, "--model.rope_beta_fast", "2"])
    assert any("model.rope_beta_fast = 2.0 is ignored" in note for note in inert_option_notes(cfg))
    cfg = _cli(["--model.init_from", hf, "--model.rope_scaling", "linear", "--model.rope_factor", "4"])
    assert cfg.model.rope_factor == 4.0 and not inert_option_notes(cfg)  # (read under a scaling: no word)
    assert not inert_option_notes(_cli(["--model.init_from", hf]))  # (the weights' own values: nothing given)
