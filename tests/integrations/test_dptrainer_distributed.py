"""DPTrainer under torchrun on 2 gloo ranks: sharded Poisson batches, summed clipped gradients, the same noise."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_end_with_identical_parameters_and_the_same_epsilon(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(ROOT / "tests" / "integrations" / "_dptrainer_ddp_worker.py"),
           str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert r0["steps"] == r1["steps"] == 4
    assert r0["epsilon"] == r1["epsilon"] <= 4.0
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    # each rank drew from its own half of the data (indices of the whole data set)
    assert all(i < 48 for b in r0["batches"] for i in b) and all(i >= 48 for b in r1["batches"] for i in b)
    assert r0["batches"] != [[i - 48 for i in b] for b in r1["batches"]]  # independent keys (fold_in(key, rank))


def _resume_on_two_ranks(tmp_path, attack: str) -> list[dict]:
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(ROOT / "tests" / "integrations" / "_dptrainer_ddp_resume_worker.py"),
           str(tmp_path), attack]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_two_ranks_resume_a_checkpoint_and_refuse_one_rank_s_spliced_accountant_together(tmp_path):
    assert [r["outcome"] for r in _resume_on_two_ranks(tmp_path / "intact", "none")] == ["ok", "ok"]
    r0, r1 = _resume_on_two_ranks(tmp_path / "forged", "spliced_accountant")
    assert r1["outcome"] == "CheckpointError" and "the accountant recorded 2 steps, the run's step is 4" in r1["message"]
    assert r0["outcome"] == "CheckpointRanksError" and "rank(s) [1] refused" in r0["message"]
    assert r0["model_unchanged"] and r1["model_unchanged"]
