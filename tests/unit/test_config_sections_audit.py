"""Config keys given in the wrong section, and a resume's change of train.seq_len: each said before any work."""

from __future__ import annotations

import pytest

from longctx.config import load_config, to_toml
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError


@pytest.mark.parametrize("args, right, wrong", [
    (["--train.recompute", "full"], "memory.recompute", "'compile'"),
    (["--model.seq_len", "64"], "train.seq_len", "'max_seq_len'"),
    (["--data.seed", "1"], "train.seed", None),
])
def test_a_key_of_another_section_names_that_section(args, right, wrong):
    """The closest key of the wrong section was suggested (train.compile for recompute; the model's max_seq_len
    for seq_len, another setting), or none at all."""
    with pytest.raises(ConfigError, match=f"Did you mean '{right}' \\(a key of") as err:
        load_config(None, args)
    assert wrong is None or f"Did you mean {wrong}" not in str(err.value)


def test_a_key_of_another_section_in_a_file_names_that_section(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nrecompute = "full"\n')
    with pytest.raises(ConfigError, match="Did you mean 'memory.recompute'"):
        load_config(path)


def _saved_run(tmp_path, *args):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config(None, [*args, f"--train.run_dir={run}"])))
    return run


def test_a_resume_that_changes_the_sequence_length_is_refused_before_any_work(tmp_path):
    """Its data is the store of that length: the checkpoint's cursor points into another store. It was accepted
    here and refused by the loader only after the new store was built and the ranks had started."""
    run = _saved_run(tmp_path, "--train.seq_len=64")
    with pytest.raises(ConfigError, match="would change the data: train.seq_len 64 -> 128"):
        load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto", "--train.seq_len=128"], False)
    cfg, resumed = load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto", "--train.seq_len=128",
                                          "--checkpoint.allow_changes=true"], False)
    assert cfg.train.seq_len == 128 and "train.seq_len 64 -> 128" in resumed.describe()


def test_a_resume_that_changes_stages_may_change_the_last_length(tmp_path):
    """Stages read a store per stage (train/stages.py): another plan of stages stays allowed."""
    run = _saved_run(tmp_path, "--train.stages=32:2,64:2")
    cfg, _ = load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto",
                                    "--train.stages=32:2,64:2,128:2"], False)
    assert cfg.train.seq_len == 128
    run2 = tmp_path / "two"
    run2.mkdir()
    (run2 / "config.toml").write_text((run / "config.toml").read_text().replace(str(run), str(run2)))
    cfg, _ = load_run_config(None, [f"--train.run_dir={run2}", "--checkpoint.resume=auto", "--train.stages=",
                                    "--train.steps=6", "--train.seq_len=32"], False)
    assert cfg.train.seq_len == 32


def test_a_toml_integer_past_a_float_is_a_config_error(tmp_path):
    """`lr = 1000...0` (401 digits) in a file: an OverflowError traceback from the loader."""
    path = tmp_path / "c.toml"
    path.write_text("[train]\nlr = 1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError, match="train.lr must be a finite number"):
        load_config(path)


@pytest.mark.parametrize("key", ["data.corpus", "data.tokenizer"])
def test_an_empty_corpus_or_tokenizer_is_refused(key):
    """'' was the path '.': the working directory's text files became the corpus, its tokenizer.json the
    tokenizer, without a word."""
    with pytest.raises(ConfigError, match=f"{key} is empty"):
        load_config(None, [f"--{key}="])


def test_allow_changes_is_asked_of_one_resume_not_inherited_from_the_saved_config(tmp_path):
    """`--checkpoint.allow_changes true` given to one resume was written into config.toml, and every later resume
    of the run then changed the model or the data without a word."""
    run = _saved_run(tmp_path)
    resume = [f"--train.run_dir={run}", "--checkpoint.resume=auto"]
    cfg, _ = load_run_config(None, [*resume, "--data.max_docs=150", "--checkpoint.allow_changes=true"], False)
    (run / "config.toml").write_text(to_toml(cfg))  # (what the resumed run writes)
    with pytest.raises(ConfigError, match="would change the model: model.rope_theta 10000.0 -> 20000.0"):
        load_run_config(None, [*resume, "--model.rope_theta=20000"], False)
    cfg, _ = load_run_config(None, [*resume, "--train.steps=400"], False)
    assert not cfg.checkpoint.allow_changes and cfg.data.max_docs == 150


def test_print_config_on_a_resume_prints_only_toml(tmp_path, capsys):
    """The resume's "resume: ..." line went to stdout before the TOML, so `--print-config > run.toml` wrote a
    file no TOML reader (nor --config) could read; it goes to stderr there."""
    import tomllib

    from longctx.cli import main

    run = _saved_run(tmp_path)
    assert main(["train", "--checkpoint.resume=auto", f"--train.run_dir={run}", "--train.steps=400",
                 "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert tomllib.loads(out)["train"]["steps"] == 400 and "train.steps 300 -> 400" in err
