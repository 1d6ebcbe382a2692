"""Run checkpoints (DPPlan.save_checkpoint / load_checkpoint): a file that is not one step of this run is refused.

Each attack is a file written by someone who can write it: its checksum is recomputed (here
by save_checkpoint itself), so only the consistency checks can refuse it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from opake_fx.dpsgd.noise import GaussianNoiseState
from opake_fx.errors import CheckpointError, InputValueError
from opake_fx.optimizers import sgd
from opake_fx.plan import DPPlan
from opake_fx.random import key
from opake_fx.serialization import load_checkpoint, save_checkpoint
from opake_fx.transforms import apply_updates

N, B, STEPS = 64, 8, 6
DATA = torch.linspace(-2.0, 2.0, N * 2).reshape(N, 2)


def _loss(p, x):
    return ((x - p) ** 2).sum()


class Run:
    """A plan, its pipeline, sampler and accountant, stepped and saved like a training loop."""

    def __init__(self, nm: float = 1.0, **plan_kw):
        self.plan = DPPlan(dataset_size=N, batch_size=B, steps=STEPS, noise_multiplier=nm, delta=1e-5, **plan_kw)
        extra = {"count_key": key(2)} if self.plan.clipping_mode == "adaptive" else {}
        self.pipeline = self.plan.pipeline(_loss, sgd(0.1), key=key(0), batch_argnums=(1,), **extra)
        self.params = torch.zeros(2)
        self.state = self.pipeline.init(self.params)
        self.sampler = self.plan.sampler(range(N), key(1))
        self.accountant = self.plan.accountant()
        self.step = 0
        self.noises: list[torch.Tensor] = []

    def advance(self, k: int = 1) -> Run:
        for _ in range(k):
            self.accountant.step(self.plan.step_cost_at(self.step))
            batch = DATA[self.sampler.batch(self.step)]
            updates, self.state = self.pipeline.update((batch,), self.state, self.params)
            self.params = apply_updates(self.params, updates)
            self.step += 1
        return self

    def save(self, path) -> None:
        self.plan.save_checkpoint(path, params=self.params, state=self.state, sampler=self.sampler,
                                  accountant=self.accountant)

    def templates(self) -> dict:
        return dict(params=torch.zeros(2), state=self.pipeline.init(torch.zeros(2)), sampler=self.sampler,
                    accountant=self.plan.accountant())

    def load(self, path) -> dict:
        return self.plan.load_checkpoint(path, **self.templates())


def _forge(path, run: Run, **replace):
    """Rewrites ``path`` as its writer can: every tree read back, some replaced, saved with a fresh checksum."""
    trees = load_checkpoint(path, **run.templates(), run={"plan": "", "step": 0})
    trees.update(replace)
    if "sampler" in trees and not isinstance(trees["sampler"], dict):
        trees["sampler"] = trees["sampler"].state_dict()
    save_checkpoint(path, **trees)


def test_a_run_resumes_where_it_stopped(tmp_path):
    a = Run().advance(2)
    a.save(tmp_path / "c.pt")
    ckpt = a.load(tmp_path / "c.pt")
    assert ckpt["step"] == 2 and ckpt["sampler"].next_step == 2 and ckpt["accountant"].steps == 2
    assert ckpt["state"]["noise"].step == 2 and torch.equal(ckpt["params"], a.params)


def test_rewound_noise_step_is_refused(tmp_path):
    # Steps 0-1's noise drawn again at steps 2-3 would cancel against the model released at step 2.
    a = Run().advance(2)
    a.save(tmp_path / "c.pt")
    _forge(tmp_path / "c.pt", a, state={**a.state, "noise": GaussianNoiseState(key(0), step=0)})
    with pytest.raises(CheckpointError, match=r"state/noise\.step is 0, the run's step is 2"):
        a.load(tmp_path / "c.pt")


def test_rewound_clip_step_and_sampler_position_are_refused(tmp_path):
    a = Run().advance(2)
    a.save(tmp_path / "c.pt")
    _forge(tmp_path / "c.pt", a, state={**a.state, "clip": dataclasses.replace(a.state["clip"], step=1)},
           sampler={**a.sampler.state_dict(), "next_step": 0})
    with pytest.raises(CheckpointError) as err:
        a.load(tmp_path / "c.pt")
    assert "state/clip.step is 1" in str(err.value) and "sampler's position (next_step) is 0" in str(err.value)


def test_an_earlier_accountant_spliced_into_a_later_checkpoint_is_refused(tmp_path):
    a = Run().advance(3)
    a.save(tmp_path / "early.pt")
    early = a.load(tmp_path / "early.pt")["accountant"]  # genuine, from step 3
    a.advance(1)
    a.save(tmp_path / "late.pt")
    _forge(tmp_path / "late.pt", a, accountant=early)  # 4 steps taken, 3 would be reported
    with pytest.raises(CheckpointError) as err:
        a.load(tmp_path / "late.pt")
    assert "the accountant recorded 3 steps, the run's step is 4" in str(err.value)
    assert "is not the plan's first 4 steps" in str(err.value)


def test_an_accountant_with_the_right_count_but_another_history_is_refused(tmp_path):
    a = Run().advance(2)
    a.save(tmp_path / "c.pt")
    cheaper = Run(nm=5.0).plan.step_cost  # two steps recorded, but of a mechanism with 5x the noise
    forged = a.plan.accountant()
    for _ in range(2):
        forged.step(cheaper)
    _forge(tmp_path / "c.pt", a, accountant=forged)
    with pytest.raises(CheckpointError, match="accountant's history"):
        a.load(tmp_path / "c.pt")


def test_adaptive_count_noise_turned_off_in_the_file_is_refused(tmp_path):
    a = Run(clipping_mode="adaptive").advance(2)
    a.save(tmp_path / "c.pt")
    clip = a.state["clip"]
    assert clip.count_noise_multiplier == pytest.approx(0.4)  # batch_size / 20
    _forge(tmp_path / "c.pt", a, state={**a.state, "clip": dataclasses.replace(clip, count_noise_multiplier=0.0)})
    for load in (a.load, lambda p: load_checkpoint(p, state=a.pipeline.init(torch.zeros(2)))):
        with pytest.raises(CheckpointError, match=r"count_noise_multiplier=0\.0 \(the pipeline has 0\.4\)"):
            load(tmp_path / "c.pt")


def test_adaptive_count_noise_removed_from_the_last_count_is_refused(tmp_path):
    from opake_fx.dpsgd.clipping.adaptive import next_clipping_norm

    a = Run(clipping_mode="adaptive").advance(2)
    a.save(tmp_path / "c.pt")
    clip = dataclasses.replace(a.state["clip"], count_noise=0.0)
    clip = dataclasses.replace(clip, clipping_norm=next_clipping_norm(clip, clip.centered_count))  # the exact count's norm
    _forge(tmp_path / "c.pt", a, state={**a.state, "clip": clip})
    with pytest.raises(CheckpointError, match="is not the noise drawn for step 1"):
        a.load(tmp_path / "c.pt")


def test_adaptive_state_of_another_configuration_is_refused_at_run_time():
    a = Run(clipping_mode="adaptive").advance(1)
    state = {**a.state, "clip": dataclasses.replace(a.state["clip"], count_noise_multiplier=0.0)}
    with pytest.raises(InputValueError, match=r"count_noise_multiplier=0\.0 \(this function's: 0\.4\)"):
        a.pipeline.update((DATA[:4],), state, a.params)


def test_fixed_clip_norm_saved_differently_is_refused(tmp_path):
    a = Run().advance(1)
    a.save(tmp_path / "c.pt")
    _forge(tmp_path / "c.pt", a, state={**a.state, "clip": dataclasses.replace(a.state["clip"], clipping_norm=100.0)})
    with pytest.raises(CheckpointError, match=r"clipping_norm=100\.0 \(the pipeline has 1\.0\)"):
        a.load(tmp_path / "c.pt")


def test_a_checkpoint_of_another_plan_is_refused_from_inside_the_file(tmp_path):
    a = Run(nm=1.0).advance(2)
    a.save(tmp_path / "c.pt")
    b = Run(nm=0.5)
    with pytest.raises(CheckpointError, match=r"another privacy plan \(differs in \['noise_multiplier'\]"):
        b.load(tmp_path / "c.pt")


def test_a_file_without_the_run_tree_is_refused(tmp_path):
    a = Run().advance(1)
    save_checkpoint(tmp_path / "c.pt", params=a.params, state=a.state, sampler=a.sampler, accountant=a.accountant)
    with pytest.raises(CheckpointError, match="was not written by DPPlan.save_checkpoint"):
        a.load(tmp_path / "c.pt")


def test_swapped_noise_key_is_refused(tmp_path):
    a = Run().advance(1)
    a.save(tmp_path / "c.pt")
    _forge(tmp_path / "c.pt", a, state={**a.state, "noise": GaussianNoiseState(key(1), step=1)})  # the sampler's key
    with pytest.raises(CheckpointError, match=r"state/noise\.key is RngKey\(0, 1\), the pipeline's is RngKey\(0, 0\)"):
        a.load(tmp_path / "c.pt")


def test_a_refused_load_changes_nothing(tmp_path):
    a = Run().advance(2)
    a.save(tmp_path / "c.pt")
    _forge(tmp_path / "c.pt", a, state={**a.state, "noise": GaussianNoiseState(key(0), step=0)})
    templates = a.templates()
    with pytest.raises(CheckpointError):
        a.plan.load_checkpoint(tmp_path / "c.pt", **templates)
    assert templates["sampler"].next_step == 0 and templates["accountant"].steps == 0
    assert templates["state"]["noise"].step == 0 and a.state["noise"].step == 2


def test_save_refuses_an_inconsistent_run(tmp_path):
    a = Run().advance(2)
    a.accountant.step(a.plan.step_cost_at(2))  # charged, but the step was not taken
    with pytest.raises(InputValueError, match="the accountant recorded 3 steps, the run's step is 2"):
        a.save(tmp_path / "c.pt")
    assert not (tmp_path / "c.pt").exists()
    b = Run().advance(2)
    with pytest.raises(InputValueError, match="step counters disagree"):
        b.plan.save_checkpoint(tmp_path / "c.pt", params=b.params,
                               state={**b.state, "noise": GaussianNoiseState(key(0), step=1)})


@pytest.mark.parametrize("plan_kw", [dict(mechanism="blt", sampling="b_min_sep", min_sep=2),
                                     dict(mechanism="band_mf", sampling="cyclic_poisson", bands=2)])
def test_dpftrl_runs_resume_and_refuse_a_rewound_step(tmp_path, plan_kw):
    a = Run(**plan_kw).advance(3)
    a.save(tmp_path / "c.pt")
    assert a.load(tmp_path / "c.pt")["step"] == 3
    noise = a.state["noise"]
    _forge(tmp_path / "c.pt", a, state={**a.state, "noise": dataclasses.replace(noise, step=1)})
    with pytest.raises(CheckpointError, match=r"state/noise\.step is 1, the run's step is 3"):
        a.load(tmp_path / "c.pt")
