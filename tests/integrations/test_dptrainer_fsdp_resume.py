"""DPTrainer checkpoints of an FSDP2-sharded run (issue 32): killed after a save, resumed, the uninterrupted run.

Two torchrun launches on 2 gloo ranks (``_dptrainer_fsdp_resume_worker.py``): ``cut`` trains with a
checkpoint every 2 steps and every rank ends its process with ``os._exit(9)`` right after the
checkpoint of step 4; ``rest`` runs the uninterrupted run, two refused resumes (a tampered DP
state, the data-parallel layout) and the resume of the killed run, in one process group (so a
refusal that left a rank behind in a collective would hang the launch instead of finishing it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from opake_fx.errors import CheckpointError  # noqa: E402
from opake_fx.transformers import DPTrainer, TrainingArguments  # noqa: E402
from tests.distributed.test_tutorial import _free_port  # noqa: E402
from tests.integrations import _hf_trainer as hf  # noqa: E402

ROOT = Path(__file__).parents[2]
WORKER = ROOT / "tests" / "integrations" / "_dptrainer_fsdp_resume_worker.py"


def _launch(out: Path, mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER), str(out), mode]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-resume")
    cut = _launch(out, "cut")
    assert cut.returncode != 0 and "exitcode  : 9" in cut.stderr, cut.stderr[-4000:]  # killed, not finished
    assert sorted(p.name for p in (out / "cut").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    rest = _launch(out, "rest")
    assert rest.returncode == 0, rest.stderr[-4000:]
    return out, [torch.load(out / f"rest.rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_sharded_run_resumes_to_the_uninterrupted_run_bit_for_bit(runs):
    out, ranks = runs
    for record in ranks:
        full, resumed = record["full"], record["resumed"]
        assert resumed["state"] == "FSDPStepState"  # the sharded step ran after the resume
        assert full["steps"] == resumed["steps"] == 6
        # the resumed model was built from another seed: every value below came from checkpoint-4
        assert sorted(resumed["params"]) == sorted(full["params"])
        for name, want in full["params"].items():
            assert torch.equal(resumed["params"][name], want), name  # trained and frozen (embedding) parameters
        assert [s for s, _, _ in resumed["logs"]] == [5, 6]
        assert resumed["logs"] == full["logs"][4:]  # losses and epsilons logged after the resume, exactly
        assert len(resumed["all_logs"]) == 6  # the history continues the killed run's
        assert resumed["epsilon"] == full["epsilon"] < float("inf")
    # the checkpoint: Hugging Face's files, the full weights at step 4, the sharded DP state in dp_state/
    files, r0 = ranks[0]["checkpoint_files"], ranks[0]
    assert {"dp_state", "accountant.json", "model.safetensors", "trainer_state.json", "rng_state_0.pth",
            "rng_state_1.pth"} <= set(files)
    assert not [f for f in files if f.startswith("dp_state.rank")]
    assert r0["dp_state_files"] == ["meta.json", "run.rank0.pt", "run.rank1.pt", "tensors"]
    weights, at_save = r0["checkpoint_weights"], r0["full"]["at_save"]
    assert sorted(weights) == sorted(at_save)
    for name, want in at_save.items():
        assert torch.equal(weights[name], want), name
    assert not torch.equal(weights["lm_head.weight"], r0["full"]["params"]["lm_head.weight"])  # step 4's, not the end's


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sharded_dp_state_with_one_rank_s_file_of_another_step_is_refused_on_every_rank(runs):
    _, ranks = runs
    for rank, record in enumerate(ranks):
        got = record["tampered"]
        assert got["outcome"] in ("CheckpointError", "CheckpointRanksError"), got
        assert "the ranks restored different state/noise.step" in got["message"]
        assert f"run.rank{rank}.pt" in got["message"]
        assert got["model_unchanged"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_data_parallel_checkpoint_resumed_under_fsdp_is_refused_on_every_rank(runs):
    _, ranks = runs
    for rank, record in enumerate(ranks):
        got = record["dp_layout"]
        assert got["outcome"] == "CheckpointError" and got["model_unchanged"]
        assert (f"was saved by a data-parallel run (its DP state is one file per rank, dp_state.rank{rank}.pt), and "
                "this run shards the model (fsdp)") in got["message"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sharded_checkpoint_resumed_by_one_unsharded_process_is_refused(runs):
    """Another world size (1) and no fsdp: the message names the layout, the ranks that saved it and what to do."""
    from tests.integrations._dptrainer_fsdp_resume_worker import tiny_llama

    out, _ = runs
    args = TrainingArguments(output_dir=str(out / "one"), per_device_train_batch_size=8, max_steps=6,
                             learning_rate=1e-2, privacy_noise_multiplier=1.0, privacy_seed=3, **hf.COMMON)
    trainer = DPTrainer(model=tiny_llama(1), args=args, train_dataset=hf.counting_lm_data(96))
    before = hf.trainable(trainer.model)
    with pytest.raises(CheckpointError, match=r"was saved by a sharded \(fsdp\) run on 2 ranks .* Resume it with the "
                                              r"same fsdp arguments under torchrun on that number of ranks"):
        hf.quiet_train(trainer, resume_from_checkpoint=str(out / "cut" / "checkpoint-4"))
    after = hf.trainable(trainer.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
