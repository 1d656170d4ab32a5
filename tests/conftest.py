import os

import pytest
import torch

# Under pytest-xdist (`-n 2` in pyproject's addopts) the workers share the cores: each takes its part
# of them for its own matmuls, rather than every worker running as many threads as there are cores
# (oversubscribed, they wait for each other). Spawned ranks set their own count (job/spawn.py).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


def _session_cache_dir(tmp_path_factory):
    """This test session's cache directory. Under pytest-xdist one for all the workers: their base
    directories (popen-gw0, popen-gw1) sit in the session's, so a data store that one worker built is
    reused by the other, not built again (9 of the stores a suite of 2026-12-04 built were built by both
    workers, each 0.7-1.4 s of CPU). Builds and calibrations publish by rename, safe when two workers race
    (data/default_store.py, costs/peaks.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "longctx-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("longctx-cache")


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """Data stores that training builds on first use go to a temporary cache, not ~/.cache/longctx
    (an environment variable, so spawned ranks and CLI subprocesses use the same one)."""
    old = os.environ.get("LONGCTX_CACHE")
    os.environ["LONGCTX_CACHE"] = str(_session_cache_dir(tmp_path_factory))
    yield
    if old is None:
        os.environ.pop("LONGCTX_CACHE", None)
    else:
        os.environ["LONGCTX_CACHE"] = old


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on one thread (on a shared 2-core machine more threads only wait for each other); a module
    asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_from_another_module(request):
    """A default process group left by an earlier module (an in-process run that failed before
    finish_distributed, which ends only the groups of jobs that succeed) is ended before this module
    starts, with a warning naming the module that left it: else the next fixture that creates its own
    group failed with "trying to initialize the default process group twice!" depending on which
    files an xdist worker happened to run before it (a suite on 2026-12-03: test_planner_slow_links's set-up)."""
    import warnings

    import torch.distributed as dist

    from longctx.job import launch

    global _LAST_MODULE
    if dist.is_available() and dist.is_initialized():
        warnings.warn(f"a default process group was left by {_LAST_MODULE}; ended before {request.module.__name__}",
                      stacklevel=1)
        launch._destroy_process_group()  # (and comm's caches of its groups, as a job's own end does)
    # what launch records of a group it created goes with it: left set, the next in-process command's
    # finish_distributed ended a group this module's own fixture made ("theirs to end") under the fixture
    launch._CREATED = False
    _LAST_MODULE = request.module.__name__
    yield


_LAST_MODULE = "an earlier module"


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# tests that start processes (distributed/) or run commands end to end (e2e/) are the slow tier:
# `pytest -m "not slow"` is the everyday loop, `pytest` runs everything (CI)
SLOW_DIRS = ("distributed", "e2e")


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if any(part in SLOW_DIRS for part in item.path.relative_to(config.rootpath).parts[:-1]):
            item.add_marker(pytest.mark.slow)
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Freeze what collection left alive (every collected module, function and fixture: about 560,000 tracked
    objects when a worker collects the whole suite) out of the collector's scans. A full gc.collect() then walks
    only what the tests made since, not that heap: 0.4 s of CPU per call otherwise, in every in-process
    command's end (job/launch.py release_groups), memory measurements and audits. Cycles among the tests' own
    objects are still found and freed; nothing frozen here is garbage (collected just before)."""
    import gc

    gc.collect()
    gc.freeze()
