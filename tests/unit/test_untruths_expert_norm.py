"""Under expert parallelism the expert weights' gradient norm is one all-reduce over every rank
(issue 53 item 10): ParallelDims.build_expert_mesh registers the flattened (expert_data, expert)
mesh, so DTensor neither reduces the norm dim by dim nor warns on every rank that this "may give
inconsistent results between ranks". One process on PyTorch's fake process group (no transfers):
only the plan of the reduction is under test; the values are the distributed tests' (training
parity under expert degrees)."""

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from longctx.job.dims import ParallelDims


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield 4
    finally:
        dist.destroy_process_group()


def test_the_expert_gradient_norm_is_one_reduction_without_a_warning(fake_world):
    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger, keep = logging.getLogger("torch.distributed.tensor._redistribute"), Keep(logging.WARNING)
    logger.addHandler(keep)
    try:
        mesh = ParallelDims(ctx=4, world_size=fake_world, expert=2).build_expert_mesh("cpu")
        assert mesh.mesh_dim_names == ("expert_data", "expert")
        # an expert weight's gradient as FSDP leaves it: experts split over `expert`, rows over `expert_data`
        grad = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(1), Shard(0)])
        torch.nn.utils.get_total_norm([grad], norm_type=2.0, foreach=True).full_tensor()
    finally:
        logger.removeHandler(keep)
    assert not [m for m in said if "inconsistent results between ranks" in m], said
