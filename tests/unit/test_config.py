import pytest

from longctx.config import (
    MODEL_PRESETS,
    Config,
    build_config,
    load_config,
    parse_overrides,
    to_dict,
    to_toml,
)
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError


def test_defaults_are_debug_preset():
    cfg = load_config()
    for key, value in MODEL_PRESETS["debug"].items():
        assert getattr(cfg.model, key) == value, key


def test_toml_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[train]\nsteps = 7\nlr = 1\n[data]\ndoc_mask = false\n')
    cfg = load_config(p, ["--train.steps=9", "--model.layers", "3", "--checkpoint.async", "--data.corpus=stdlib"])
    assert cfg.train.steps == 9  # CLI wins over file
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # TOML int accepted for a float
    assert cfg.model.layers == 3
    assert cfg.data.doc_mask is False
    assert cfg.checkpoint.async_save is True  # bare bool flag; key 'async' maps to field async_save


def test_preset_fills_fields_not_set_explicitly():
    cfg = load_config(overrides=["--model.preset=llama3-8b", "--model.layers=2", "--train.seq_len=512"])
    assert (cfg.model.dim, cfg.model.heads, cfg.model.kv_heads, cfg.model.layers) == (4096, 32, 8, 2)
    assert cfg.model.rope_scaling == "llama3" and cfg.model.rope_theta == 500000.0


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--train.nonsense=1"], "unknown config key 'train.nonsense'"),
        (["--trian.steps=1"], "Did you mean 'train'"),
        (["--train.setps=1"], "Did you mean 'steps'"),
        (["--train.steps=abc"], "train.steps must be an integer"),
        (["--train.steps=0"], "train.steps must be positive"),
        (["--model.heads=7", "--model.kv_heads=2"], "model.heads (7) must be divisible by model.kv_heads (2)"),
        (["--model.rope_scaling=ntk"], "valid choices: none, linear, llama3, yarn"),
        (["--train.dtype=fp16"], "auto, fp32, bf16"),
        (["--parallel.ctx=4", "--parallel.window=3"],
         "parallel.window (3) must be 0 (plain ring) or divide parallel.ctx (4)"),
        (["--parallel.head=3"], "model.heads (4) must be divisible by parallel.head (3)"),
        (["--data.doc_mask=maybe"], "must be true or false"),
        (["--train.seq_len=200000"], "exceeds model.max_seq_len"),
        (["steps=3"], "unexpected argument 'steps=3'"),
    ],
)
def test_bad_values_are_rejected_with_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert needle in str(e.value)


def test_bad_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[train]\nsteps = 'many'\n")
    with pytest.raises(ConfigError, match="train.steps must be an integer"):
        load_config(p)
    p.write_text("[trainn]\nsteps = 1\n")
    with pytest.raises(ConfigError, match="unknown config section 'trainn'"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_print_config_round_trips(tmp_path):
    cfg = load_config(overrides=["--model.preset=llama3-1b", "--train.lr=0.0001", "--checkpoint.async=true",
                                 "--data.corpus=some \"dir\""])
    p = tmp_path / "out.toml"
    p.write_text(to_toml(cfg))
    again = load_config(p)
    assert to_dict(again) == to_dict(cfg)
    assert to_dict(again) != to_dict(Config())


def test_parse_overrides_equals_and_space_forms_agree():
    assert parse_overrides(["--train.steps=3"]) == parse_overrides(["--train.steps", "3"]) == {"train": {"steps": 3}}


def test_build_config_reports_all_problems_at_once():
    with pytest.raises(ConfigError) as e:
        build_config({"train": {"steps": -1, "lr": -1.0}})
    assert "train.steps" in str(e.value) and "train.lr" in str(e.value)


@pytest.mark.parametrize("old,new", [("memory.checkpoint", "recompute"), ("train.batch_size", "global_batch")])
def test_an_old_key_is_an_unknown_key_listing_the_valid_ones(tmp_path, old, new):
    with pytest.raises(ConfigError, match=f"unknown config key '{old}'. Valid keys in .*{new}"):
        load_config(overrides=[f"--{old}=4"])
    section, key = old.split(".")
    path = tmp_path / "old.toml"
    path.write_text(f"[{section}]\n{key} = 4\n")
    with pytest.raises(ConfigError, match=f"unknown config key '{old}'"):
        load_config(path)


def test_global_batch_must_divide_into_micro_batches():
    with pytest.raises(ConfigError, match="divisible by train.grad_accum"):
        load_config(overrides=["--train.global_batch=6", "--train.grad_accum=4"])
    assert load_config(overrides=["--train.global_batch=8", "--train.grad_accum=4"]).train.global_batch == 8


def test_offload_fraction_is_a_number_or_the_word_auto(tmp_path):
    """memory.offload_fraction is typed `float | str`: a number (TOML int or float, CLI text), or the
    one word 'auto'; a MemoryPolicy takes only the number."""
    from longctx.memory.policy import MemoryPolicy

    recompute = "--memory.recompute=selective"
    assert load_config(overrides=[recompute, "--memory.offload_fraction=0.25"]).memory.offload_fraction == 0.25
    p = tmp_path / "c.toml"
    p.write_text('[memory]\nrecompute = "selective"\noffload_fraction = 1\n')
    one = load_config(p).memory.offload_fraction
    assert one == 1.0 and isinstance(one, float)
    auto = load_config(overrides=[recompute, "--memory.offload_fraction=auto"])
    assert auto.memory.offload_fraction == "auto"
    with pytest.raises(ValueError, match="resolve it"):
        MemoryPolicy.from_config(auto.memory)
    assert MemoryPolicy.from_config(load_config(p).memory).offload_fraction == 1.0
    for bad in ("automatic", "half"):
        with pytest.raises(ConfigError, match="memory.offload_fraction must be a number"):
            load_config(overrides=[recompute, f"--memory.offload_fraction={bad}"])
    p.write_text('[memory]\nrecompute = "selective"\noffload_fraction = "most"\n')
    with pytest.raises(ConfigError, match="memory.offload_fraction must be a number"):
        load_config(p)


def test_a_renamed_key_is_refused_naming_the_new_one_but_a_saved_run_still_resumes(tmp_path):
    """parallel.split became parallel.seq_balance ('split' is the data store's train/eval split): a
    flag or a config file with the old name stops before any work with a message that names the new
    key; a run's own config.toml saved before the rename still resumes, read under the new name."""
    old = tmp_path / "old.toml"
    old.write_text('[parallel]\nsplit = "zigzag"\n')
    with pytest.raises(ConfigError, match=r"parallel.split in '.*old.toml' is now called parallel.seq_balance .*"
                                          r"seq_balance = \.\.\. in its \[parallel\] table"):
        load_config(old)
    with pytest.raises(ConfigError, match=r"parallel.split is now called parallel.seq_balance .*"
                                          r"--parallel.seq_balance="):
        load_config(overrides=["--parallel.split=zigzag"])
    assert load_config(overrides=["--parallel.seq_balance=zigzag"]).parallel.seq_balance == "zigzag"

    run = tmp_path / "run"  # a run saved before the rename: its config.toml says split
    run.mkdir()
    text = to_toml(load_config(None, ["--parallel.seq_balance=zigzag", "--train.steps=4"]))
    assert text.count("seq_balance = ") == 1
    (run / "config.toml").write_text(text.replace("seq_balance = ", "split = "))
    cfg, resumed = load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto"], False)
    assert cfg.parallel.seq_balance == "zigzag" and resumed.changes == []
