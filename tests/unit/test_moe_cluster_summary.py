"""bench moe --cluster's summary: a repeat's exposed communication is the slowest rank's own (as
docs/benchmarks.md and bench/moe_cluster.py say), not the largest over the ranks."""

from longctx.bench.moe_cluster import summarize


def _run(step, exposed, inter=10):
    return {"step_s": step, "exposed_s": exposed, "cross_node_bytes": inter}


def _rank(seq, sched, hier):
    return {"slowdown": 1.0, "profile": {}, "schedules": {"sequential": seq, "scheduled_2": sched},
            "hierarchical": hier}


def test_exposed_time_is_the_slowest_ranks_own():
    spec = {"repeats": 2, "zipf": 0, "schedules": [("sequential", 1), ("scheduled_2", 2)]}
    # rank 0 is the slowest in every run; rank 1 waits longer on the links
    per_rank = [_rank([_run(10.0, 3.0), _run(9.0, 2.0)], [_run(8.0, 1.0), _run(7.0, 0.5)],
                      [_run(9.5, 2.5), _run(9.4, 2.4)]),
                _rank([_run(9.0, 6.0), _run(8.0, 5.0)], [_run(7.5, 4.0), _run(6.0, 3.0)],
                      [_run(9.0, 5.5), _run(9.1, 5.4)])]
    doc = summarize(per_rank, spec)
    assert doc["sequential_s"] == 9.0 and doc["exposed_comm_sequential"] == 2.0
    assert doc["scheduled_s"] == 7.0 and doc["exposed_comm_scheduled"] == 0.5
    assert doc["exposed_ratio"] == 0.25
    assert doc["hierarchical_s"] == 9.4 and doc["exposed_comm_hierarchical"] == 2.4
    assert doc["cross_node_bytes_flat"] == 20 and doc["cross_node_bytes_hierarchical"] == 20
    assert [r["exposed_s"] for r in doc["schedules"]["sequential"]["repeats"]] == [3.0, 2.0]
