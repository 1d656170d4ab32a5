import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """Data stores that training builds on first use go to a temporary cache, not ~/.cache/longctx
    (an environment variable, so spawned ranks and CLI subprocesses use the same one)."""
    import os

    old = os.environ.get("LONGCTX_CACHE")
    os.environ["LONGCTX_CACHE"] = str(tmp_path_factory.mktemp("longctx-cache"))
    yield
    if old is None:
        os.environ.pop("LONGCTX_CACHE", None)
    else:
        os.environ["LONGCTX_CACHE"] = old


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
