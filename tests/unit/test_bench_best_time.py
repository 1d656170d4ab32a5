"""bench/attention_common.py best_time: the wall and the CPU figure are each the best of the repeats.
It once took the lexicographic minimum of (wall, cpu) pairs, so the CPU seconds the attention benches
compare were those of the fastest wall-clock repeat, not the fewest."""

from longctx.bench import attention_common


def test_wall_and_cpu_are_each_the_best_of_the_repeats(monkeypatch):
    # three repeats: (wall, cpu) = (1.0, 5.0), (2.0, 0.5), (3.0, 4.0)
    walls, cpus = iter([0.0, 1.0, 10.0, 12.0, 20.0, 23.0]), iter([0.0, 5.0, 10.0, 10.5, 20.0, 24.0])
    monkeypatch.setattr(attention_common.time, "perf_counter", lambda: next(walls))
    monkeypatch.setattr(attention_common.time, "process_time", lambda: next(cpus))
    assert attention_common.best_time(lambda: None, 3) == (1.0, 0.5)
