"""Shared fixtures: the persistent gloo pools of tests/helpers/pool.py; hypothesis profiles.

Property tests draw the same examples on every run ("ci", the default: a CI failure is a
real fault, reproducible from the log); `HYPOTHESIS_PROFILE=explore` draws fresh random
examples on every run, to look for new failures locally."""

import os

import pytest
from hypothesis import settings

from tests.helpers.pool import PoolRegistry

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def pools():
    """`pools.get(n)` -> a GlooPool of n ranks, shared by the whole session."""
    registry = PoolRegistry()
    yield registry
    registry.close()
