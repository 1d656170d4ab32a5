"""eval's process groups after one rank fails, and a finished eval rank noted for its launcher (helper task
evalhang110; the job itself: tests/e2e/test_evalhang110_cli.py).

Failed before: an error of --mode generate (rank 0 alone stopped or out of memory, say) went to
finish_distributed, whose barrier waited for ranks still in the next decode step's collective, for good; a failed run
now ends only a one-rank group (end_one_rank_group, no barrier), as generate and train do. And no eval rank noted a
finished run, so a signal to the launcher after every rank had finished said the job was stopped.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from longctx.eval import command, generate_mode
from longctx.job import launch, relaunch


class _RankFailed(RuntimeError):
    pass


@pytest.fixture
def groups(monkeypatch):
    """What eval did to the process groups, in order."""
    calls = []
    monkeypatch.setattr(launch, "finish_distributed", lambda: calls.append("finish"))
    monkeypatch.setattr(launch, "end_one_rank_group", lambda: calls.append("end one-rank group"))
    return calls


def _fail(requests, args_list):
    raise _RankFailed("rank 0 alone failed")


def _requests(*modes):
    return [SimpleNamespace(mode=mode) for mode in modes]


@pytest.mark.parametrize("modes", [("generate",), ("score", "generate")])
def test_a_failed_generate_run_ends_its_groups_without_a_barrier(monkeypatch, groups, modes):
    """--mode generate (alone, or after ppl's scored tasks) that raises: no barrier, the error raised as it was."""
    ran = []

    def run_mode(mode):
        ran.append(mode)
        return _fail if mode == "generate" else (lambda requests, args_list: [{"task": "ppl"}])

    monkeypatch.setattr(command, "_run_mode", run_mode)
    with pytest.raises(_RankFailed):
        command.evaluate_tasks(_requests(*modes), [None] * len(modes))
    assert ran == list(modes)
    assert groups == ["end one-rank group"]


def test_a_failed_score_run_ends_its_groups_without_a_barrier(monkeypatch, groups):
    monkeypatch.setattr(command, "_run_mode", lambda mode: _fail)
    with pytest.raises(_RankFailed):
        command.evaluate_tasks(_requests("score"), [None])
    assert "finish" not in groups


def test_a_whole_run_still_ends_its_groups_with_the_barrier(monkeypatch, groups):
    monkeypatch.setattr(command, "_run_mode", lambda mode: lambda requests, args_list: [{"mode": mode}])
    assert command.evaluate_tasks(_requests("score", "generate"), [None, None]) == [{"mode": "score"},
                                                                                   {"mode": "generate"}]
    assert groups == ["finish"]


def test_evaluate_generate_that_fails_waits_for_no_peer(monkeypatch, groups):
    monkeypatch.setattr(generate_mode, "generate_tasks", _fail)
    with pytest.raises(_RankFailed):
        generate_mode.evaluate_generate(None, None)
    assert groups == ["end one-rank group"]
    groups.clear()
    monkeypatch.setattr(generate_mode, "generate_tasks", lambda requests, args_list: [{"task": "passkey"}])
    assert generate_mode.evaluate_generate(None, None) == {"task": "passkey"}
    assert groups == ["finish"]


def _rank_of_two(tmp_path, monkeypatch, rank: int, evaluate):
    """`longctx eval`'s main as rank `rank` of a `--nproc 2` job, its evaluation `evaluate`."""
    monkeypatch.setenv(relaunch.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(launch, "check_launcher_env", lambda *a, **k: (rank, 2))
    monkeypatch.setattr("longctx.eval.request.prepare",
                        lambda args, overrides, nproc: SimpleNamespace(mode="generate", notes=[], lengths=[128]))
    monkeypatch.setattr(command, "task_args", lambda args, tasks: [args])
    monkeypatch.setattr(command, "evaluate_tasks", evaluate)
    monkeypatch.setattr(command, "keep_stopped", lambda *a: None)
    written = []

    def write(result, args):  # (rank 0's JSON: the rank has not noted its run finished before it is out)
        written.append((result, (tmp_path / f"finished{rank}").exists()))

    monkeypatch.setattr(command, "_write", write)
    monkeypatch.setattr(command, "_write_plot", lambda part, args: None)
    args = SimpleNamespace(task="passkey", output="", argv=["eval"], nproc=1)
    return command.main(args, []), written


@pytest.mark.parametrize("rank", [0, 1])
def test_a_finished_eval_rank_notes_it_for_the_launcher_after_its_result_is_out(tmp_path, monkeypatch, rank):
    """A signal to the launcher once every rank finished (rank 0: its JSON written) is a note, not a stop."""
    code, written = _rank_of_two(tmp_path, monkeypatch, rank,
                                 lambda requests, args_list: [{"task": "passkey"}] if rank == 0 else None)
    assert code == 0
    assert written == ([({"task": "passkey"}, False)] if rank == 0 else [])
    assert (tmp_path / f"finished{rank}").exists()


def test_a_failed_eval_rank_notes_nothing(tmp_path, monkeypatch):
    with pytest.raises(_RankFailed):
        _rank_of_two(tmp_path, monkeypatch, 0, _fail)
    assert not (tmp_path / "finished0").exists()


def test_the_launcher_takes_a_late_signal_to_a_finished_eval_as_a_note(tmp_path, monkeypatch, capsys):
    """Both ranks noted their run finished: SIGTERM to the launcher then stops nothing (exit 0, one note)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    for rank in (0, 1):
        (tmp_path / f"finished{rank}").write_text("")

    def run(_args):
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    relaunch._relaunch(2, ["eval", "--checkpoint", "hf:x"], 0.5, tmp_path)
    assert "came after every rank had finished the run; nothing was stopped" in capsys.readouterr().err
