"""Shared fixtures: the persistent gloo pools of tests/helpers/pool.py."""

import pytest

from tests.helpers.pool import PoolRegistry


@pytest.fixture(scope="session")
def pools():
    """`pools.get(n)` -> a GlooPool of n ranks, shared by the whole session."""
    registry = PoolRegistry()
    yield registry
    registry.close()
