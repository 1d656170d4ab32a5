"""`--section.key=value` overrides and TOML config files as a demanding user writes them: every mis-written input
is one ConfigError, before any work, that says what was wrong and what to write instead; none is a silent wrong
value. Before: `--steps=5` said only "unexpected argument"; `--train.steps=1e3` gave no fix; `--train.run_dir=None`
made a directory named None; `--data.path=[a,b]` read the stores '[a' and 'b]'; a value quoted twice by a script
kept its quotes; a TOML list for a comma-separated key, or a table for a plain key ("unknown key train.steps.a"),
named no fix; a key set twice in a file (quoted "moe.experts" and [model.moe]) kept the later, unsaid;
`--model.moe=8` and `[train.extra]` listed the keys and said nothing of sub-tables; `--train.steps=-5` also
blamed metrics.profile_step, which was at its default."""

import pytest

from longctx.cli import main
from longctx.config import load_config
from longctx.errors import ConfigError


def _refused(overrides=None, toml: str | None = None, tmp_path=None) -> str:
    path = None
    if toml is not None:
        path = tmp_path / "c.toml"
        path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


@pytest.mark.parametrize("arg, meant", [
    ("--steps=5", "Did you mean --train.steps=5?"),  # a key without its section
    ("--seq-len=64", "Did you mean --train.seq_len=64?"),  # ... and a dash for the underscore
    ("--layers=2", "Did you mean --model.layers=2 or --draft.layers=2?"),  # a key of two sections: both
    ("train.steps=5", "Did you mean --train.steps=5?"),  # no dashes
    ("-train.steps=5", "Did you mean --train.steps=5?"),  # one dash
    ("--train-steps=5", "Did you mean --train.steps=5?"),  # a dash for the dot
    ("--train_steps=5", "Did you mean --train.steps=5?"),  # an underscore for the dot
])
def test_a_mis_written_override_names_the_flag_meant(arg, meant):
    said = _refused([arg])
    assert f"unexpected argument '{arg}'" in said and meant in said


def test_an_unrelated_argument_gets_no_guess():
    assert "Did you mean" not in _refused(["--bogus=1"]) and "Did you mean" not in _refused(["extra"])


def test_the_command_line_says_the_flag_meant_without_a_traceback(capsys):
    assert main(["train", "--print-config", "--steps=5"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean --train.steps=5?" in err and "Traceback" not in err


@pytest.mark.parametrize("text, fix", [("1e3", "1e3 is 1000: write --train.steps=1000."),
                                       ("10.5", "10.5 has a fraction: give a whole number."),
                                       ("", "leave --train.steps out for its default, 300."),
                                       ("None", "leave --train.steps out for its default, 300.")])
def test_an_integer_flag_says_what_to_write(text, fix):
    said = _refused([f"--train.steps={text}"])
    assert "train.steps must be an integer" in said and fix in said


def test_a_boolean_given_no_value_and_a_decimal_comma_say_the_fix():
    said = _refused(["--train.compile="])
    assert "must be true or false" in said and "leave --train.compile out for its default, false." in said
    assert "Write the decimal point as '.': --train.lr=1.5." in _refused(["--train.lr=1,5"])


def test_an_integer_written_as_a_float_in_toml_says_the_whole_number(tmp_path):
    said = _refused(toml="[train]\nsteps = 1e3\n", tmp_path=tmp_path)
    assert "train.steps must be an integer, got 1000.0 (float). 1000.0 is 1000: write steps = 1000." in said


@pytest.mark.parametrize("args, fix", [
    (["--data.path", "'my store'"], "pass it without them: --data.path=my store."),
    (["--train.run_dir=\"runs/a\""], "pass it without them: --train.run_dir=runs/a."),
    (["--train.lr='1e-4'"], "pass it without them: --train.lr=1e-4."),
])
def test_a_value_quoted_twice_is_refused_with_the_value_unquoted(args, fix):
    said = _refused(args)
    assert "wrapped in quotes" in said and fix in said


@pytest.mark.parametrize("flag", ["--train.run_dir=None", "--checkpoint.dir=null", "--metrics.file=None",
                                  "--data.path=NULL"])
def test_none_is_no_value_of_a_path(flag):
    key = flag[2:].split("=")[0]
    said = _refused([flag])
    assert "the config has no None or null" in said and f"--{key}= (empty)" in said


def test_none_in_a_toml_string_is_refused_and_a_path_named_none_can_be_given(tmp_path):
    said = _refused(toml='[train]\nrun_dir = "None"\n', tmp_path=tmp_path)
    assert "train.run_dir = 'None': the config has no None or null" in said
    assert load_config(None, ["--train.run_dir=./None"]).train.run_dir == "./None"


def test_a_comma_list_in_brackets_is_refused():
    said = _refused(["--data.path=[a, b]"])
    assert "write the items comma-separated, without brackets: --data.path=a, b" in said
    assert "without brackets" in _refused(["--checkpoint.on_signal=[SIGTERM]"])


@pytest.mark.parametrize("toml, fix", [
    ('[data]\npath = ["a", "b"]\n', 'Write the items in one string, comma-separated: path = "a,b".'),
    ('[data]\nweights = [0.7, 0.3]\n', 'weights = "0.7,0.3".'),
    ('[checkpoint]\non_signal = []\n', 'No items are written "": on_signal = "".'),
])
def test_a_toml_list_for_a_comma_separated_key_says_the_string(toml, fix, tmp_path):
    said = _refused(toml=toml, tmp_path=tmp_path)
    assert "must be a string" in said and fix in said


def test_a_table_for_a_plain_key_is_refused_as_its_type(tmp_path):
    said = _refused(toml="[train]\nsteps = { a = 1 }\n", tmp_path=tmp_path)
    assert "train.steps must be an integer, got {'a': 1} (dict)." in said and "train.steps.a" not in said


def test_a_key_set_twice_in_a_file_is_refused(tmp_path):
    toml = '[model]\npreset = "debug-moe"\n"moe.experts" = 4\n[model.moe]\nexperts = 8\n'
    said = _refused(toml=toml, tmp_path=tmp_path)
    assert "model.moe.experts is set twice" in said and "keep one" in said
    p = tmp_path / "ok.toml"  # (either spelling alone is fine)
    p.write_text('[model]\npreset = "debug-moe"\nmoe.experts = 4\n')
    assert load_config(p).model.moe_experts == 4


def test_sub_tables_are_named_in_the_refusal(tmp_path):
    said = _refused(["--model.moe=8"])
    assert "model.moe is a sub-table of keys (moe.experts" in said and "--model.moe.experts=VALUE" in said
    said = _refused(toml="[train.extra]\nsteps = 5\n", tmp_path=tmp_path)
    assert "[train] has no sub-table 'extra'. Did you mean 'train.steps'?" in said
    said = _refused(toml="[model.mo]\nexperts = 8\n", tmp_path=tmp_path)
    assert "[model] has no sub-table 'mo' (its sub-tables: moe). Did you mean 'moe'?" in said
    assert "Did you mean 'moe.top_k'?" in _refused(["--model.moe.topk=2"])  # (a key of a sub-table misspelled)


def test_a_negative_step_count_is_one_refusal():
    said = _refused(["--train.steps", "-5"])
    assert said == "train.steps must be positive, got -5."


def test_good_values_read_as_written():
    """What must keep working: usual number spellings, negatives in both forms, every boolean spelling, values
    holding '=', commas, spaces and non-ASCII text, taken verbatim."""
    cfg = load_config(None, ["--train.lr=.5", "--parallel.dp_shard", "-1", "--train.seed=+3", "--train.steps=1_000",
                             "--train.compile=On", "--train.deterministic", "no",
                             "--train.run_dir=runs/ünï cödé=1,2", "--data.path", "a b, c"])
    assert (cfg.train.lr, cfg.parallel.dp_shard, cfg.train.seed, cfg.train.steps) == (0.5, -1, 3, 1000)
    assert (cfg.train.compile, cfg.train.deterministic) == (True, False)
    assert cfg.train.run_dir == "runs/ünï cödé=1,2" and cfg.data.path == "a b,c"


def test_precedence_preset_then_file_then_flags(tmp_path):
    """docs/running.md: the model preset, then a --config file, then the flags; a flag given twice: the last."""
    p = tmp_path / "c.toml"
    p.write_text('[model]\npreset = "small-100m"\nlayers = 2\n[train]\nsteps = 7\n')
    cfg = load_config(p, ["--model.layers=3", "--train.steps=5", "--train.steps", "9"])
    assert (cfg.model.dim, cfg.model.layers, cfg.train.steps) == (768, 3, 9)
    cfg = load_config(p, ["--model.preset=llama3-1b"])  # (a hand-written file keeps its keys over any preset)
    assert (cfg.model.dim, cfg.model.layers) == (2048, 2)


@pytest.mark.parametrize("given, meant", [("None", "none"), ("null", "none"), ("Auto", "auto")])
def test_a_resume_word_in_another_spelling_is_pointed_to(given, meant, tmp_path, monkeypatch):
    """--checkpoint.resume=None read as a path that is not there: the refusal named no fix."""
    from longctx.config.checkpoint_paths import CheckpointError, resolve_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=f"Did you mean --checkpoint.resume {meant} "):
        resolve_checkpoint(given, tmp_path / "checkpoints")
