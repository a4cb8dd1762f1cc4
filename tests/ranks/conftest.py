"""Tests on live ranks: ``run_ranks`` serves them from this worker's pool of ranks
(``tests/pool.py``), unless the test or its module is marked ``fresh_ranks(reason)``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import harness


@pytest.fixture(autouse=True)
def _ranks_from_the_pool(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("fresh_ranks") is not None:
        yield
        return
    with harness.pooled():
        yield
