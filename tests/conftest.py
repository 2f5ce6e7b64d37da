"""Shared fixtures: the persistent gloo pools of tests/pool.py."""

import pytest

from tests.pool import PoolRegistry


@pytest.fixture(scope="session")
def pools():
    """`pools.get(n)` -> a GlooPool of n ranks, shared by the whole session."""
    registry = PoolRegistry()
    yield registry
    registry.close()
