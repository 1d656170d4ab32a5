"""The `longctx train` configuration and launch audit (config92):
- a resume whose saved config.toml holds a key this version no longer has was refused as
  "unknown config key 'train.old_knob'", as if the command line had given it: now the error names the saved
  file, and how to go on (edit it, or a new run from its weights);
- a data-parallel degree that cannot be inferred (the named degrees' product does not divide the ranks) said
  so with no fix: now it names the ranks (--nproc) that fit;
- a number key that also takes a word (memory.offload_fraction: auto) given another ('AUTO', 'half') said "must
  be a number": now the word too, and the case-insensitive match;
- a --config file in another encoding than TOML's UTF-8 (UTF-16, as Windows editors save "Unicode") was a raw
  UnicodeDecodeError traceback, and a directory given as --config "did not exist";
- a train.seq_len the head x ctx layout cannot cut said "sequence length 500 is not divisible ..." and named no
  key (a last stage's length the same, without its train.stages): now the key and the degrees;
- key/value heads that a head degree cannot split said so and no more: now the head degrees that work;
- WORLD_SIZE without RANK (or RANK without WORLD_SIZE), half of a launcher's pair: the process was no rank, so
  it ran a whole job of its own (the default 4 local ranks), as each of its peers did, into one run directory,
  without a word: now one error naming the missing variable (train, eval, generate).
"""

import pytest
from test_launch_env_audit import _env as _only

from longctx.config import Config, to_toml
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError


def test_a_saved_config_with_a_removed_key_is_named_as_the_saved_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(Config()).replace("[train]\n", "[train]\nold_knob = 3\n"))
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto"], layout_given=False)
    said = str(e.value)
    assert f"the saved config of the run to resume, {run / 'config.toml'}, no longer loads" in said
    assert "unknown config key 'train.old_knob'" in said and "Edit that file" in said
    assert f"--model.init_from {run / 'checkpoints'}" in said


@pytest.mark.parametrize("degrees, world, fix", [({"head": 2, "ctx": 4}, 4, "--nproc 8"),
                                                 ({"head": 2}, 1, "--nproc 2")])
def test_a_degree_that_cannot_be_inferred_says_how_many_ranks_fit(degrees, world, fix):
    """`--parallel.head 2 --parallel.ctx 4` on the default 4 ranks, or `--parallel.head 2` resuming a 1-rank run:
    the error said dp_shard 'cannot be inferred' and nothing of a fix."""
    from longctx.job.dims import ParallelDims

    with pytest.raises(ConfigError, match="cannot be inferred") as e:
        ParallelDims(**degrees, world_size=world)
    assert fix in str(e.value)


def test_kv_heads_a_head_degree_cannot_split_name_the_degrees_that_work():
    from longctx.job.checks import check_heads

    with pytest.raises(ConfigError, match="2 key/value heads cannot be split over head-parallel degree 3") as e:
        check_heads(6, 2, 3)
    assert "choose parallel.head among [1, 2, 6]" in str(e.value) and "model.kv_heads" in str(e.value)


@pytest.mark.parametrize("given", [["--memory.offload_fraction", "AUTO"], {"memory": {"offload_fraction": "Auto"}}])
def test_a_number_that_takes_a_word_says_the_word(given):
    from longctx.config import load_config

    with pytest.raises(ConfigError, match="memory.offload_fraction must be a number or 'auto', got") as e:
        load_config(None, given)
    assert "Did you mean 'auto'?" in str(e.value)


def test_a_config_file_not_in_utf8_or_a_directory_is_one_clear_error(tmp_path):
    from longctx.config import load_config

    (tmp_path / "utf16.toml").write_text("[train]\nsteps = 5\n", encoding="utf-16")
    with pytest.raises(ConfigError, match="is not valid TOML: TOML files are UTF-8 text, and byte 0 is not"):
        load_config(tmp_path / "utf16.toml")
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_config(tmp_path)


@pytest.mark.parametrize("given, key", [
    (["--train.seq_len=500"], "train.seq_len with parallel.ctx 2 x parallel.head 2"),
    (["--train.stages=1000:2,500:2"], "train.stages")])
def test_a_length_the_layout_cannot_cut_names_its_key(given, key):
    from longctx.config import load_config
    from longctx.job.checks import check_layout

    with pytest.raises(ConfigError, match="sequence length 500 is not divisible by 2 x ctx x head") as e:
        check_layout(load_config(None, [*given, "--parallel.head=2", "--parallel.ctx=2"]), 4)
    assert str(e.value).startswith(f"{key}: ")




@pytest.mark.parametrize("env, missing", [({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512"},
                                           "RANK"), ({"RANK": "1"}, "WORLD_SIZE")])
@pytest.mark.parametrize("command", [
    ["train", "--train.steps=1"], ["eval", "--checkpoint", "x", "--task", "ppl", "--lengths", "64", "--nproc", "2"],
    ["generate", "--checkpoint", "x"]])
def test_half_of_a_launchers_pair_is_refused_before_any_work(env, missing, command, monkeypatch, tmp_path, capsys):
    from longctx import cli

    _only(monkeypatch, **env)
    started = []
    monkeypatch.setattr(cli, "_train", lambda *a: started.append(a) or 0)  # (the whole job of one process)
    monkeypatch.chdir(tmp_path)
    assert cli.main(command) == 2
    err = " ".join(capsys.readouterr().err.split())
    given = next(k for k in ("WORLD_SIZE", "RANK") if k in env)
    assert f"{given}={env[given]} is set but {missing} is not" in err and f"unset {given}" in err
    assert started == [] and not any(tmp_path.iterdir())
