"""Shared test configuration: hypothesis profiles and small fixtures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

DATA = Path(__file__).parent / "data"

# "ci" is derandomised (the same examples on every run) so CI is reproducible;
# "dev" explores new examples each run. CI and `make test` set HYPOTHESIS_PROFILE=ci (.ci/run, Makefile);
# a bare `pytest` explores ("dev").
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", deadline=None, max_examples=50, suppress_health_check=[HealthCheck.too_slow])
# "nightly": long fuzzing (tests/fuzz/ run 2000+ draws per test under it); otherwise as "ci".
settings.register_profile("nightly", parent=settings.get_profile("ci"), max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def threefry_fixtures() -> dict:
    return json.loads((DATA / "threefry.json").read_text())


@pytest.fixture(scope="session")
def accounting_fixtures() -> dict:
    return json.loads((DATA / "accounting.json").read_text())
