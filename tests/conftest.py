"""Shared test configuration: deterministic hypothesis profiles and single-threaded torch."""

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))  # deterministic unless asked

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every device this machine has: CPU always, CUDA when present."""
    return torch.device(request.param)


@pytest.fixture(scope="module")
def one_rank():
    """A real one-process gloo group, so the collective code paths (exchanges, all-gathers) run here."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
