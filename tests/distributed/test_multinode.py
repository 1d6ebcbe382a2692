"""Two torchrun agents with a real c10d rendezvous on localhost (``--nnodes 2``): the seed tutorial and an
FSDP2 tiny Llama run as on two nodes (issue 32). Slow: each launch starts two agents and their workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_tutorial import _WRAPPER, _free_port

ROOT = Path(__file__).resolve().parents[2]


def _two_nodes(tmp_path: Path, *script_and_args: str, timeout: float = 300.0, exit_code: int = 0) -> list[str]:
    """Runs ``script_and_args`` as 2 nodes x 1 process: two torchrun agents meeting at one c10d endpoint."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    endpoint = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={endpoint}", "--rdzv-id=opake-multinode", *script_and_args]
    agents = [subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = []
    for agent in agents:
        try:
            out, _ = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            raise
        assert (agent.returncode == 0) == (exit_code == 0), f"an agent exited with {agent.returncode}:\n{out[-6000:]}"
        outs.append(out)
    return outs


@pytest.mark.slow
@pytest.mark.distributed
def test_the_seed_tutorial_runs_on_two_nodes(tmp_path):
    wrapper = tmp_path / "run_tutorial.py"
    wrapper.write_text(_WRAPPER)
    out = tmp_path / "params.pt"
    text = "".join(_two_nodes(tmp_path, str(wrapper), str(ROOT / "examples" / "distributed_dp_training.py"), str(out)))
    assert "Rank 0/2 on cpu" in text and "Rank 1/2 on cpu" in text
    eps = float(re.search(r"Final epsilon: ([0-9.]+)", text).group(1))
    assert 3.0 - 1e-2 <= eps <= 3.0 and torch.load(out)["params"]


@pytest.mark.slow
@pytest.mark.distributed
def test_an_fsdp2_tiny_llama_trains_on_two_nodes(tmp_path):
    pytest.importorskip("transformers")
    text = "".join(_two_nodes(tmp_path, str(ROOT / "examples" / "fsdp_llama.py")))
    held = re.findall(r"\[rank (\d)/2\] holds (\d+) of (\d+) parameters; epsilon ([0-9.]+) per example", text)
    assert sorted(h[0] for h in held) == ["0", "1"]
    assert all(int(local) < int(total) for _, local, total, _ in held)  # each node holds a shard
    assert sum(int(local) for _, local, _, _ in held) == int(held[0][2])  # the shards cover the model once
    assert all(float(eps) <= 8.0 for *_, eps in held)


_KILLED_AFTER_3_SAVES = """
import os, runpy, sys
from opake_fx.plan import DPPlan

save, saved = DPPlan.save_checkpoint, []


def save_then_die(self, *args, **kwargs):
    out = save(self, *args, **kwargs)
    if not kwargs["params"]:  # the run file a sharded save writes through the same method
        return out
    saved.append(out)
    if len(saved) == 3:
        os._exit(9)  # killed: no clean-up, no destroy_process_group
    return out


DPPlan.save_checkpoint = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_bf16_fsdp2_run_on_two_nodes_resumes_to_the_same_parameters(tmp_path):
    pytest.importorskip("transformers")
    example = str(ROOT / "examples" / "fsdp_llama.py")
    pattern = r"\[rank (\d)/2\] holds \d+ of \d+ parameters; epsilon ([0-9.]+) per example .*parameter sum (\S+)"
    whole = re.findall(pattern, "".join(_two_nodes(tmp_path, example, "--bf16", "--checkpoint", "a")))
    killer = tmp_path / "killed.py"
    killer.write_text(_KILLED_AFTER_3_SAVES)
    _two_nodes(tmp_path, str(killer), example, "--bf16", "--checkpoint", "b", exit_code=9)
    assert (tmp_path / "b" / "meta.json").exists() and not (tmp_path / "b" / "run.rank2.pt").exists()
    text = "".join(_two_nodes(tmp_path, example, "--bf16", "--checkpoint", "b"))
    assert text.count("resumed at step 3") == 2
    resumed = re.findall(pattern, text)
    assert sorted(whole) == sorted(resumed) and len(whole) == 2  # the same parameters and epsilon, on both nodes
