"""What a `longctx bench` command's ranks refused after the spawn (a traceback, rc 1, after minutes of other
work) is refused before any work, exit 2: `bench generate --sharded 4x1` on 2 heads (after the whole
transformers comparison ran), `bench moe --cluster 1x3` on 16 experts (every rank's reshape error), `bench moe
--cluster --hardware nosuch` (every rank's ConfigError), and `bench comm --plot` into a missing directory (the PNG
drawn after every mode ran; the JSON is now printed before it)."""

import pytest

from longctx.bench.arg_checks import check_bench_args
from longctx.cli import build_parser
from longctx.errors import ConfigError


def _args(*argv):
    return build_parser("bench").parse_args(["bench", *argv])


@pytest.mark.parametrize("argv, said", [
    (("generate", "--sharded", "4x1", "--heads", "2", "--kv-heads", "2", "--dim", "32"),
     "--sharded 4x1: 2 attention heads are not divisible by the head-parallel degree 4"),
    (("generate", "--sharded", "2x1", "--heads", "6", "--kv-heads", "3", "--dim", "48"),
     "--sharded 2x1: 3 key/value heads cannot be split over head-parallel degree 2"),
    (("moe", "--cluster", "1x3"), "--cluster 1x3: the 16 experts of small-moe are split over all 3 ranks"),
    (("moe", "--cluster", "2x3", "--model", "debug-moe"), "give NODES x RANKS of 2, 4, 8 ranks"),
    (("moe", "--cluster", "1x2", "--hardware", "nosuch"), "--hardware nosuch: choose among h100"),
    (("comm", "--cluster", "2x1", "--steps", "300", "--plot", "/nonexistent/dir/loss.png"),
     "--plot /nonexistent/dir/loss.png cannot be written: /nonexistent/dir does not exist"),
])
def test_what_the_ranks_would_refuse_is_refused_first(argv, said):
    with pytest.raises(ConfigError) as e:
        check_bench_args(argv[0], _args(*argv))
    assert said in str(e.value)


@pytest.mark.parametrize("argv", [
    ("generate", "--sharded", "2x2", "--heads", "4", "--kv-heads", "2", "--dim", "32"),
    ("moe", "--cluster", "2x4", "--model", "debug-moe", "--hardware", "H200"),
    ("moe", "--cluster", "2x2", "--hardware", "cpu"),
])
def test_layouts_that_run_are_taken(argv):
    check_bench_args(argv[0], _args(*argv))


def test_bench_comm_prints_its_json_before_the_plot(monkeypatch, capsys):
    from longctx.bench import comm_cluster

    modes = {"fsdp": {"step_s": 1.0, "exposed_s": 0.1, "inter_node_bytes": 10.0, "intra_node_bytes": 5.0,
                      "intra_group_bytes": 0.0, "losses": [1.0]}}
    monkeypatch.setattr(comm_cluster, "check_modes", lambda spec: None)
    monkeypatch.setattr(comm_cluster, "run_spawned", lambda *a, **k: [{"profile": {}, "modes": modes}])

    def full_disk(*_a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(comm_cluster, "_plot", full_disk)
    args = _args("comm", "--cluster", "2x1", "--modes", "fsdp", "--timed", "1", "--steps", "10", "--plot", "x.png")
    with pytest.raises(OSError):
        comm_cluster.main(args)
    assert '"bench": "comm"' in capsys.readouterr().out
