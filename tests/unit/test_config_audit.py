"""The configuration layer against what the docs promise: a wrong value is refused before any work,
never read as something else (docs/running.md: "A wrong key, type or value stops the run before any
work"). Expected values are written out by hand, not taken from the code under test."""

import pytest

from longctx.cli import build_parser
from longctx.config import load_config, to_toml
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError


def _refused(overrides, needle, path=None):
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert needle in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# values


@pytest.mark.parametrize("flag", ["--train.lr=nan", "--train.lr=inf", "--train.lr=1e400", "--train.weight_decay=nan",
                                  "--train.grad_clip=nan", "--train.eps=nan", "--train.spike_factor=nan",
                                  "--model.norm_eps=nan", "--model.rope_theta=inf", "--model.init_std=nan",
                                  "--parallel.timeout_s=inf", "--metrics.peak_tflops=nan", "--draft.kd_temperature=inf",
                                  "--train.co2_outer_lr=nan"])
def test_a_non_finite_number_is_refused_naming_the_key(flag):
    """nan passes every `value <= 0` check (a NaN lr trained a run whose every step was skipped); 1e400
    overflows to inf. No knob means anything by either."""
    _refused([flag], f"{flag[2:].split('=')[0]} must be a finite number")


def test_a_non_finite_number_in_a_toml_file_or_a_dict_is_refused(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nweight_decay = nan\n")
    _refused(None, "train.weight_decay must be a finite number", path=p)
    _refused({"model": {"preset": "debug-moe", "moe.aux_loss": float("-inf")}}, "model.moe.aux_loss must be a finite")


@pytest.mark.parametrize("overrides, needle", [
    (["--model.preset=debug-moe", "--model.moe.route_scale=-1"], "model.moe.route_scale must be positive"),
    (["--model.preset=debug-moe", "--model.moe.route_scale=0"], "model.moe.route_scale must be positive"),
    (["--checkpoint.resume="], "checkpoint.resume is empty"),
])
def test_a_value_with_no_meaning_is_refused(overrides, needle):
    """route_scale multiplies every routing weight (0 silences the experts and leaves them and the
    router without a gradient from the loss; no model has a negative one); an empty resume path is the
    working directory."""
    _refused(overrides, needle)


@pytest.mark.parametrize("text, expected", [("true", True), ("True", True), ("1", True), ("yes", True), ("on", True),
                                            ("false", False), ("False", False), ("0", False), ("no", False),
                                            ("NO", False), ("off", False)])
def test_bool_spellings(text, expected):
    assert load_config(None, [f"--train.compile={text}"]).train.compile is expected
    assert load_config(None, ["--train.compile", text]).train.compile is expected


@pytest.mark.parametrize("flag, needle", [("--train.compile=2", "must be true or false"),
                                          ("--train.compile=", "must be true or false"),
                                          ("--train.steps=2.5", "must be an integer"),
                                          ("--train.steps=1e3", "must be an integer"),
                                          ("--train.steps=0x10", "must be an integer"),
                                          ("--train.lr=", "must be a number")])
def test_a_value_of_the_wrong_type_is_refused(flag, needle):
    _refused([flag], needle)


def test_numbers_in_their_usual_spellings():
    cfg = load_config(None, ["--train.steps=1_000", "--train.lr=1e-3", "--parallel.dp_shard", "-1"])
    assert (cfg.train.steps, cfg.train.lr, cfg.parallel.dp_shard) == (1000, 0.001, -1)


def test_a_choice_in_other_capitals_is_refused_with_the_right_spelling():
    _refused(["--train.dtype=BF16"], "Did you mean 'bf16'?")


def test_a_missing_value_does_not_swallow_the_next_option():
    """`--train.run_dir --train.steps=3` made run_dir the string '--train.steps=3' and trained 300 steps."""
    _refused(["--train.run_dir", "--train.steps=3"], "--train.run_dir needs a value")
    _refused(["--checkpoint.dir", "--checkpoint.interval", "5"], "--checkpoint.dir needs a value")
    cfg = load_config(None, ["--train.compile", "--train.steps=3"])  # a bare bool flag stays true
    assert (cfg.train.compile, cfg.train.steps) == (True, 3)


def test_the_last_of_a_key_given_twice_wins_and_the_command_line_beats_the_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nsteps = 7\n")
    assert load_config(p, ["--train.steps=5", "--train.steps", "9"]).train.steps == 9


def test_the_cli_hands_negative_values_and_config_flags_through_in_order():
    args, rest = build_parser("train").parse_known_args(
        ["train", "--train.seed", "-1", "--config", "x.toml", "--train.lr", "-1e-3", "--nproc=2"])
    assert (args.nproc, rest) == (2, ["--train.seed", "-1", "--train.lr", "-1e-3"])


def test_train_refuses_a_second_config_file(tmp_path, capsys):
    """argparse kept the last --config: `--config base.toml --config mine.toml` trained without base's keys."""
    for name, steps in (("a.toml", 7), ("b.toml", 9)):
        (tmp_path / name).write_text(f"[train]\nsteps = {steps}\n")
    a, b = str(tmp_path / "a.toml"), str(tmp_path / "b.toml")
    args, rest = build_parser("train").parse_known_args(["train", "--print-config", "--config", a, "--config", b])
    with pytest.raises(ConfigError, match="--config takes one file, got 2"):
        args.func(args, rest)
    args, rest = build_parser("train").parse_known_args(["train", "--print-config", "--nproc", "1", "--config", a])
    assert args.func(args, rest) == 0 and "\nsteps = 7\n" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# presets


@pytest.mark.parametrize("order", [0, 1])
def test_an_explicit_model_key_wins_over_the_preset_in_either_order(order):
    flags = ["--model.preset=debug-moe", "--model.moe.experts=4"]
    cfg = load_config(None, flags if order else flags[::-1])
    # debug-moe's other keys (expert_dim 128, dense layer 0, aux 0.01) fill the rest
    assert (cfg.model.moe_experts, cfg.model.moe_expert_dim, cfg.model.moe_dense_layers) == (4, 128, "0")
    assert cfg.model.moe_aux_loss == 0.01 and cfg.model.dim == 128


def test_a_file_key_wins_over_a_command_line_preset(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[model]\nlayers = 3\n[model.moe]\ntop_k = 1\nnorm_topk = false\n")
    cfg = load_config(p, ["--model.preset=small-moe"])
    assert (cfg.model.layers, cfg.model.dim, cfg.model.moe_experts, cfg.model.moe_top_k) == (3, 512, 16, 1)


def test_a_command_line_preset_over_a_saved_config_builds_that_preset(tmp_path):
    """A run's saved config.toml lists every model key; with --model.preset naming another preset, its keys
    that only restate its own preset (or the default) overrode the flag's: the run built the file's model
    under the flag's name. Now the flag's preset decides them; a key the file changed stays on top of it."""
    p = tmp_path / "config.toml"
    p.write_text(to_toml(load_config(None, ["--model.preset=debug-moe", "--model.moe.router=sinkhorn",
                                            "--model.rope_theta=50000"])))
    want = load_config(None, ["--model.preset=llama3-1b", "--model.moe.router=sinkhorn", "--model.rope_theta=50000"])
    got = load_config(p, ["--model.preset=llama3-1b"])
    assert got.model == want.model and (got.model.dim, got.model.layers, got.model.moe_experts) == (2048, 16, 0)
    assert load_config(p, ["--model.preset=debug-moe"]).model == load_config(p).model  # the file's own preset
    assert load_config(p, ["--model.preset=debug", "--model.layers=2"]).model.layers == 2  # a flag beats both
    # a hand-written file (configs/passkey-pretrain.toml pins the RoPE base) keeps every key it gives
    hand = tmp_path / "hand.toml"
    hand.write_text('[model]\npreset = "debug"\nrope_theta = 10000.0\ndim = 128\n')
    cfg = load_config(hand, ["--model.preset=llama3-1b"]).model
    assert (cfg.rope_theta, cfg.dim, cfg.layers) == (10000.0, 128, 16)


# ---------------------------------------------------------------------------------------------
# resume


def _saved_run(tmp_path, overrides):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config(None, overrides)))
    return run


def _resume(run, overrides):
    return load_run_config(None, ["--train.run_dir", str(run), "--checkpoint.resume", "auto", *overrides],
                           layout_given=False)


def test_a_resume_keeps_the_saved_settings_and_applies_the_new_flags(tmp_path):
    run = _saved_run(tmp_path, ["--train.lr=1e-3", "--checkpoint.interval=10", "--train.steps=20"])
    cfg, resumed = _resume(run, ["--train.steps=30", "--train.weight_decay=0.05"])
    assert (cfg.train.lr, cfg.checkpoint.interval, cfg.train.steps, cfg.train.weight_decay) == (1e-3, 10, 30, 0.05)
    assert resumed.changes == ["train.steps 20 -> 30", "train.weight_decay 0.1 -> 0.05"]
    with pytest.raises(ConfigError, match=r"would change the shapes of the model.s weights \(model.layers 4 -> 2\)"):
        _resume(run, ["--model.layers=2"])


def test_a_resume_of_a_staged_run_takes_new_stages(tmp_path):
    """The saved config.toml holds the old stages' sum and last length as train.steps and seq_len;
    new stages on a resume were refused as contradicting a train.steps the user never gave."""
    run = _saved_run(tmp_path, ["--train.stages=64:2,128:3"])
    cfg, resumed = _resume(run, ["--train.stages=64:2,128:6"])
    assert (cfg.train.steps, cfg.train.seq_len) == (2 + 6, 128)
    assert "train.steps 5 -> 8" in resumed.changes
    with pytest.raises(ConfigError, match="contradicts train.stages"):  # a train.steps given is still checked
        _resume(run, ["--train.stages=64:2,128:6", "--train.steps=9"])


def test_a_resume_with_another_seed_is_refused_before_start_up_when_a_checkpoint_exists(tmp_path):
    """The data position is a cursor into the seed's order: the loader refused another seed only once the ranks,
    model and data had started. Refused when the config is read; a run with no checkpoint yet starts afresh."""
    run = _saved_run(tmp_path, ["--train.seed=3"])
    cfg, resumed = _resume(run, ["--train.seed=4"])  # no checkpoint: nothing to continue
    assert cfg.train.seed == 4 and resumed.changes == ["train.seed 3 -> 4"]
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "checkpoints" / "step-00000002" / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"train.seed 3 -> 4: its checkpoint's data order was drawn with seed 3.*"
                                          r"--train.seed 3"):
        _resume(run, ["--train.seed=4"])
    assert _resume(run, ["--train.seed=4", "--checkpoint.resume=none"])[0].train.seed == 4  # (a new run: no resume)
    assert _resume(run, [])[0].train.seed == 3


# ---------------------------------------------------------------------------------------------
# eval's flags


@pytest.mark.parametrize("flag", ["--train.seq_len=65536", "--train.seed=3", "--train.global_batch=8"])
def test_eval_refuses_a_train_key_it_would_overwrite_or_never_read(tmp_path, flag):
    """eval set train.seq_len to the longest --lengths and the batch to --batch over whatever was
    given, and never read train.seed: `--train.seq_len 65536` evaluated the --lengths only, without a word."""
    import json

    from longctx.eval.request import _config

    (tmp_path / "config.json").write_text(json.dumps({  # a tiny Llama, written out (no weights are read)
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{tmp_path}", "--tokenizer", "byte", "--task", "ppl", "--lengths", "128", flag])
    with pytest.raises(ConfigError, match=f"{flag[2:].split('=')[0]} does not apply"):
        _config(args, rest, [128], 1)
    # train.compile is read (score mode's model is parallelised, its blocks compiled): taken (review)
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{tmp_path}", "--tokenizer", "byte", "--task", "ppl", "--lengths", "128",
         "--train.compile=true"])
    assert _config(args, rest, [128], 1)[0].train.compile


# ---------------------------------------------------------------------------------------------
# the written config.toml


@pytest.mark.parametrize("text", ["runs/exp-\U0001f600", "runs/\U00020000", "runs/\u00e9\x7f\"\\x\ty\x01", "plain/run"])
def test_a_written_config_reads_back_every_string(tmp_path, text):
    """JSON writes a character past U+FFFF as a surrogate pair, which TOML refuses: a run directory
    with an emoji wrote a config.toml that neither --config nor a resume could read."""
    import tomllib

    written = to_toml(load_config(None, [f"--train.run_dir={text}", f"--data.corpus={text}"]))
    assert written.isascii()
    assert tomllib.loads(written)["train"]["run_dir"] == text
    (tmp_path / "c.toml").write_text(written)
    assert load_config(tmp_path / "c.toml").data.corpus == text


# ---------------------------------------------------------------------------------------------
# plan's flags


@pytest.mark.parametrize("flags", [["--model.preset=debug"], ["--model.preset", "debug"],
                                   ["--model.init_from=hf:/nowhere"]])
def test_plan_refuses_a_second_model_beside_its_model_flag(flags):
    """`longctx plan --model llama3-8b --model.preset=debug` planned the 128-wide debug model."""
    from longctx.planner.cli import build_request

    args, rest = build_parser("plan").parse_known_args(
        ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "32K", *flags])
    with pytest.raises(ConfigError, match="takes the model from --model"):
        build_request(args, rest)
