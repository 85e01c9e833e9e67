"""Fixtures of the unit tier."""

import pytest


@pytest.fixture()
def one_rank(tmp_path):
    """A one-process gloo group: the collectives of a checkpoint then run for real."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
