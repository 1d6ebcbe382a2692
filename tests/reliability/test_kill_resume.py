"""Kill and resume: a private run SIGKILLed at random moments resumes bit for bit.

``_train.py`` runs DP-SGD (Poisson sampler, adaptive clipping, Adam, an Accountant) or
DP-FTRL (BLT noise, momentum SGD, an Accountant) in a subprocess that checkpoints every
step. Here it is killed — by itself at a chosen point (inside a save: the temporary file
written, not yet renamed; or between the update and the save), or by this process at a
random step — and restarted until it finishes. The final parameters must equal, bit for
bit, those of a run that was never interrupted, every step must have used the same batch
and the same noise (steps re-run after a kill included), and the spent process and the
spent epsilon must be the same, bit for bit (the checkpoint holds the Accountant's running
composition).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from opake_fx.testing import assert_trees_equal
from tests.reliability import _train

ROOT = Path(__file__).parents[2]
TIMEOUT = 120.0


def _command(mode: str, directory: Path, die_at: str = "", rank: int = 0, world: int = 1, store: str = "") -> list[str]:
    cmd = [sys.executable, "-m", "tests.reliability._train", "--mode", mode, "--dir", str(directory)]
    if die_at:
        cmd += ["--die-at", die_at]
    if world > 1:
        cmd += ["--rank", str(rank), "--world", str(world), "--store", store]
    return cmd


def _start(cmds: list[list[str]]) -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in cmds]


def _log_lines(directory: Path, rank: int = 0) -> int:
    path = directory / f"log.rank{rank}.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _attempt(mode: str, directory: Path, kill: str, world: int, attempt: int) -> None:
    """One run of every rank, ended as ``kill`` says: ``"self:STEP:PHASE"`` (rank 0 kills
    itself), ``"after:K"`` (SIGKILL every rank once rank 0 logged K more steps) or ``""``
    (run to the end)."""
    die_at = kill[len("self:"):] if kill.startswith("self:") else ""
    store = str(directory / f"store.{attempt}")
    procs = _start([_command(mode, directory, die_at if r == 0 else "", r, world, store) for r in range(world)])
    start_lines = _log_lines(directory)
    deadline = time.monotonic() + TIMEOUT
    target = start_lines + int(kill.split(":")[1]) if kill.startswith("after:") else None
    while time.monotonic() < deadline:
        if target is not None and _log_lines(directory) >= target:
            break
        if procs[0].poll() is not None:
            break
        time.sleep(0.005)
    if kill:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
    codes = [p.wait(timeout=TIMEOUT) for p in procs]
    errors = [p.stderr.read().decode()[-3000:] for p in procs]
    if not kill:
        assert codes == [0] * world, f"the run did not finish: {codes}\n" + "\n".join(errors)
    elif kill.startswith("self:"):
        assert codes[0] == -signal.SIGKILL, f"rank 0 was to kill itself at {die_at}; exit {codes[0]}\n{errors[0]}"


def _finished_run(mode: str, directory: Path, kills: list[str], world: int = 1) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    for attempt, kill in enumerate(kills + [""]):
        _attempt(mode, directory, kill, world, attempt)
    return _outcome(directory, world)


def _outcome(directory: Path, world: int) -> dict:
    out = {}
    for rank in range(world):
        final = torch.load(directory / f"final.rank{rank}.pt", weights_only=True)
        steps: dict[int, dict] = {}
        for line in (directory / f"log.rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            # A step logged before a kill and run again after the resume must repeat exactly.
            assert steps.setdefault(record["step"], record) == record, f"rank {rank} step {record['step']} differed on re-run"
        assert sorted(steps) == list(range(_train.N_STEPS)), sorted(steps)
        out[rank] = {"params": final["params"], "epsilon": final["epsilon"], "spent": final["spent"], "log": steps}
    return out


def _reference_in_process(mode: str, directory: Path) -> dict:
    directory.mkdir(parents=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train.train(mode, directory)
    finally:
        torch.set_num_threads(threads)
    return _outcome(directory, 1)


def _assert_same(resumed: dict, reference: dict) -> None:
    for rank, ref in reference.items():
        got = resumed[rank]
        assert got["log"] == ref["log"]  # the same batch, noise and parameters at every step
        assert_trees_equal(got["params"], ref["params"])
        assert got["spent"] == ref["spent"]  # every step accounted, exactly once
        assert got["epsilon"] == ref["epsilon"]  # the running composition resumed bit for bit


@pytest.mark.slow  # ~20 s each: every restart pays torch's first-backward imports again
@pytest.mark.parametrize("mode", ["dpsgd", "dpftrl"])
def test_killed_inside_a_save_resumes_bit_identically(mode, tmp_path):
    reference = _reference_in_process(mode, tmp_path / "reference")
    resumed = _finished_run(mode, tmp_path / "killed", ["self:3:save"])
    assert list((tmp_path / "killed").glob("ckpt.rank0.step4.pt.*.tmp")), "the kill inside the save left its temporary file"
    _assert_same(resumed, reference)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dpsgd", "dpftrl"])
def test_killed_at_random_steps_resumes_bit_identically(mode, tmp_path):
    rng = random.Random(f"kill-resume-{mode}")
    kills = ["self:0:step", f"self:{rng.randrange(1, 4)}:save", f"after:{rng.randrange(1, 3)}",
             f"self:{rng.randrange(5, 7)}:saved"]
    reference = _reference_in_process(mode, tmp_path / "reference")
    _assert_same(_finished_run(mode, tmp_path / "killed", kills), reference)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dpsgd", "dpftrl"])
def test_two_gloo_ranks_killed_and_resumed_match_an_uninterrupted_run(mode, tmp_path):
    rng = random.Random(f"kill-resume-2-{mode}")
    reference = _finished_run(mode, tmp_path / "reference", [], world=2)
    assert reference[0]["log"] != reference[1]["log"]  # each rank its own batches
    assert_trees_equal(reference[0]["params"], reference[1]["params"])  # ... and the same parameters
    kills = [f"self:{rng.randrange(1, 4)}:save", f"after:{rng.randrange(1, 3)}"]
    _assert_same(_finished_run(mode, tmp_path / "killed", kills, world=2), reference)
