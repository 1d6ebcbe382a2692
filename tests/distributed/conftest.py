"""Fixtures for the distributed tests: one shared 2-rank gloo group for the whole session."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.distributed._harness import RankGroup


@pytest.fixture(scope="session")
def _shared_group() -> Iterator[list[RankGroup]]:
    holder: list[RankGroup] = []
    yield holder
    for group in holder:
        group.close()


@pytest.fixture
def group2(_shared_group: list[RankGroup]) -> RankGroup:
    """A live 2-rank gloo group, shared between tests and replaced if a test broke it."""
    if not _shared_group or _shared_group[-1].broken:
        if _shared_group:
            _shared_group.pop().close()
        _shared_group.append(RankGroup(2, pg_timeout=20.0))
    return _shared_group[-1]
