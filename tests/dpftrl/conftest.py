"""Shared small strategies for the DP-FTRL tests (built once per session)."""

from __future__ import annotations

import pytest
import torch

from opake_fx import dpftrl

N = 24


@pytest.fixture(scope="session")
def small_strategies() -> dict[str, dpftrl.Strategy]:
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    schedule = dpftrl.momentum_workload(N, 0.9, learning_rates=[1.0 / (1 + 0.1 * t) for t in range(N)])
    return {
        "identity": dpftrl.identity_strategy(N),
        "band_mf_toeplitz": dpftrl.band_mf_strategy(N, 4, max_iterations=30),
        "band_mf_column_normalized": dpftrl.band_mf_strategy(N, 4, structure="column_normalized", max_iterations=30),
        "blt": dpftrl.blt_strategy(N, max_buffers=3, max_iterations=60),
        "bsr": dpftrl.bsr_strategy(N, 5),
        "bsr_schedule": dpftrl.bsr_strategy(N, 5, workload=schedule),
        "bisr": dpftrl.bisr_strategy(N, 5),
        "bisr_schedule": dpftrl.bisr_strategy(N, 5, workload=schedule),
        "lambda_cgd": dpftrl.lambda_cgd_strategy(0.7, N),
        "dense": dpftrl.dense_strategy(N, epochs=2, max_iterations=60),
    }
