"""The bad-input table: each case is run here, and docs/bad-inputs.md is rendered from the
same list, so the page stays true (regenerate it with ``OPAKE_WRITE_DOCS=1 pytest tests/test_bad_inputs.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import torch

import opake_fx.accounting as acc
import opake_fx.dpsgd.accounting as dpsgd_acc
from opake_fx import scheduling
from opake_fx.distributed import all_reduce
from opake_fx.dpsgd.clipping import clipped_grad
from opake_fx.dpsgd.noise import gaussian_noise
from opake_fx.dpsgd.sampling import PoissonSampler
from opake_fx.errors import (
    BudgetExceededError,
    CalibrationError,
    CheckpointError,
    InputTypeError,
    InputValueError,
    NoiseInputError,
    OpakeError,
    OperationError,
)
from opake_fx.optimizers import adam, sgd
from opake_fx.random import key
from opake_fx.serialization import from_state_dict, load_checkpoint, register_serializer, save_checkpoint, state_dict
from opake_fx.types import ClippedPytree, NoisedPytree

PAGE = Path(__file__).parents[1] / "docs" / "bad-inputs.md"


class Case(NamedTuple):
    function: str
    bad_input: str
    call: Callable[[], Any]
    error: type
    says: str  # a fragment of the message (checked verbatim)


def _noise_on(value: Any) -> Any:
    fn, state = gaussian_noise(noise_multiplier=1.0, key=key(0))
    return fn(value, state)


def _adam_state_with(**entries: Any) -> Any:
    opt = adam(0.1)
    flat = state_dict(opt.init({"w": torch.zeros(3)}))
    flat.update(entries)
    return from_state_dict(opt.init({"w": torch.zeros(3)}), flat)


def _renamed() -> Any:
    flat = state_dict({"w": torch.zeros(3)})
    return from_state_dict({"w": torch.zeros(3)}, {"weight": flat["w"]})


def _file(kind: str) -> Any:
    path = Path(tempfile.mkdtemp()) / "ckpt.pt"
    save_checkpoint(path, params={"w": torch.arange(32.0)})
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "altered":
        raw = torch.load(path, weights_only=True)
        raw["trees"]["params"]["w"][3] = 7.0
        torch.save(raw, path)
    elif kind == "callable":
        torch.save({"x": print}, path)
    return load_checkpoint(path, params={"w": torch.zeros(32)})


def _run_file(kind: str) -> Any:
    from opake_fx.dpsgd.noise import GaussianNoiseState
    from opake_fx.plan import DPPlan

    def make(nm: float) -> tuple[Any, Any]:
        plan = DPPlan(dataset_size=40, batch_size=8, steps=4, noise_multiplier=nm, delta=1e-5)
        return plan, plan.pipeline(lambda p, x: ((x - p) ** 2).sum(), sgd(0.1), key=key(0), batch_argnums=(1,))

    plan, pipeline = make(1.0)
    params = torch.zeros(2)
    _, state = pipeline.update((torch.ones(3, 2),), pipeline.init(params), params)
    path = Path(tempfile.mkdtemp()) / "run.pt"
    plan.save_checkpoint(path, params=params, state=state)
    if kind == "rewound":  # rewritten with the noise step of step 0 and a recomputed checksum
        run = load_checkpoint(path, run={"plan": "", "step": 0})["run"]
        save_checkpoint(path, params=params, state={**state, "noise": GaussianNoiseState(key(0), step=0)}, run=run)
    elif kind == "other_plan":
        plan, pipeline = make(2.0)
    return plan.load_checkpoint(path, params=params, state=pipeline.init(params))


def _tiny_plan() -> Any:
    from opake_fx.plan import DPPlan

    return DPPlan(dataset_size=1000, batch_size=10, steps=100, noise_multiplier=1e-8, delta=1e-5)


def _past_the_end() -> Any:
    sampler = PoissonSampler(10, sample_rate=0.5, n_steps=1, key=key(0))
    list(sampler)
    return list(sampler)


CASES = [
    # --- checkpoints
    Case("from_state_dict", "an entry renamed", _renamed, CheckpointError, "'w' is missing; unknown entries 'weight'"),
    Case("from_state_dict", "an entry of another shape", lambda: _adam_state_with(**{"mu/w": torch.zeros(4)}), CheckpointError,
         "shape (4,) in the checkpoint, the template has (3,)"),
    Case("from_state_dict", "an integer where the template has a tensor", lambda: _adam_state_with(**{"nu/w": 3}), CheckpointError,
         "the checkpoint has the int 3 where the template has a tensor"),
    Case("from_state_dict", "the old format naming classes by import path",
         lambda: from_state_dict({}, {"__opake_type__": "os:system"}), CheckpointError, "old format"),
    Case("state_dict", "a value with no serializer (a function)", lambda: state_dict({"f": print}), InputTypeError,
         "register_serializer"),
    Case("register_serializer", "not a type", lambda: register_serializer(3, to_tree=str, from_tree=lambda t, x: x),
         InputTypeError, "parameter cls=3"),
    Case("save_checkpoint", "no trees", lambda: save_checkpoint(Path(tempfile.mkdtemp()) / "c.pt"), InputValueError,
         "needs at least one named tree"),
    Case("load_checkpoint", "no such file", lambda: load_checkpoint("/nonexistent/ckpt.pt", x=0), CheckpointError,
         "no checkpoint file"),
    Case("load_checkpoint", "a truncated file", lambda: _file("truncated"), CheckpointError, "truncated, corrupted"),
    Case("load_checkpoint", "a file altered after it was written", lambda: _file("altered"), CheckpointError,
         "failed its checksum"),
    Case("load_checkpoint", "a file holding a pickled callable", lambda: _file("callable"), CheckpointError,
         "Nothing was imported"),
    Case("DPPlan.load_checkpoint", "a noise step rewound (checksum recomputed)", lambda: _run_file("rewound"),
         CheckpointError, "state/noise.step is 0, the run's step is 1"),
    Case("DPPlan.load_checkpoint", "a checkpoint of another plan", lambda: _run_file("other_plan"), CheckpointError,
         "made by another privacy plan (differs in ['noise_multiplier']"),
    Case("DPPlan.accountant", "a noise multiplier too small for a finite epsilon (1e-8)",
         lambda: _tiny_plan().accountant(), InputValueError, "epsilon at delta=1e-05 is infinite"),
    # --- noise
    Case("gaussian_noise", "noise_multiplier < 0 or NaN", lambda: gaussian_noise(noise_multiplier=-1.0, key=key(0)),
         InputValueError, "noise_multiplier must be a finite number >= 0"),
    Case("gaussian_noise", "an int instead of a key", lambda: gaussian_noise(noise_multiplier=1.0, key=42), InputTypeError,
         "parameter key=42"),
    Case("gaussian_noise", "an unknown allocation", lambda: gaussian_noise(noise_multiplier=1.0, key=key(0), allocation="x"),
         InputValueError, "allocation must be 'optimal' or 'isotropic'"),
    Case("gaussian_noise", "secure=True with exact=True",
         lambda: gaussian_noise(noise_multiplier=1.0, key=key(0), secure=True, exact=True), InputValueError,
         "cannot go with exact=True"),
    Case("noise_fn", "an unclipped gradient", lambda: _noise_on(torch.ones(2)), NoiseInputError, "Clip first"),
    Case("noise_fn", "an already noised gradient",
         lambda: _noise_on(NoisedPytree((torch.ones(2),), max_norm=1.0, noise_stddev=1.0)), NoiseInputError, "already noised"),
    # --- clipping and guaranteed values
    Case("clipped_grad", "clipping_norm <= 0", lambda: clipped_grad(lambda p, x: (p * x).sum(), clipping_norm=-1.0),
         InputValueError, "clipping_norm must be > 0"),
    Case("clipped_grad", "microbatch_size 0", lambda: clipped_grad(lambda p, x: (p * x).sum(), clipping_norm=1.0, microbatch_size=0),
         InputValueError, "microbatch_size must be a positive int or None"),
    Case("ClippedPytree", "max_norm < 0", lambda: ClippedPytree((torch.ones(1),), max_norm=-1.0), InputValueError,
         "max_norm must be > 0"),
    # --- sampling
    Case("PoissonSampler", "sample_rate outside (0, 1]", lambda: PoissonSampler(10, sample_rate=1.5, n_steps=2, key=key(0)),
         InputValueError, "sample_rate must be in (0, 1]"),
    Case("PoissonSampler", "iterating past n_steps", _past_the_end, OperationError, "has already yielded all n_steps=1 batches"),
    # --- accounting
    Case("epsilon_budget", "epsilon < 0", lambda: acc.epsilon_budget(-1.0, delta=1e-5), InputValueError,
         "epsilon must be finite and >= 0"),
    Case("gaussian (accounting)", "noise_multiplier <= 0", lambda: dpsgd_acc.gaussian(0.0), InputValueError,
         "noise_multiplier must be finite and > 0"),
    Case("poisson (accounting)", "sample_rate outside [0, 1]", lambda: dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 1.5),
         InputValueError, "sample_rate must be in [0, 1]"),
    Case("Accountant.step", "a step beyond the budget",
         lambda: acc.Accountant(acc.epsilon_budget(0.1, delta=1e-5)).step(dpsgd_acc.gaussian(1.0)), BudgetExceededError,
         "the step was not recorded"),
    Case("calibrate", "a bracket with no parameter meeting the budget",
         lambda: acc.calibrate(acc.epsilon_budget(0.01, delta=1e-5), lambda z: dpsgd_acc.gaussian(z), 0.1, 1.0),
         CalibrationError, "Widen the range"),
    # --- optimizers, schedules, keys, collectives
    Case("sgd", "learning_rate < 0", lambda: sgd(-0.1), InputValueError, "learning_rate must be finite and >= 0"),
    Case("cosine", "decay_steps 0", lambda: scheduling.cosine(1.0, decay_steps=0), InputValueError, "decay_steps >= 1"),
    Case("key", "a float seed", lambda: key(1.5), InputTypeError, "needs a Python int seed"),
    Case("key", "a seed >= 2**64", lambda: key(2**64), InputValueError, "seed below 2**64"),
    Case("all_reduce", "no process group", lambda: all_reduce(torch.ones(1)), OperationError, "init_process_group"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.function}: {c.bad_input}" for c in CASES])
def test_bad_input_raises_the_documented_error(case):
    with pytest.raises(case.error) as info:
        case.call()
    assert isinstance(info.value, OpakeError)
    assert case.says in str(info.value), str(info.value)


def render() -> str:
    rows = "\n".join(
        f"| `{c.function}` | {c.bad_input} | `{c.error.__name__}` | {c.says.replace('|', '/')} |" for c in CASES
    )
    return (
        "# Bad inputs and the errors they raise\n\n"
        "Every error opake_fx raises on purpose is an `OpakeError` (`opake_fx.errors`), also a\n"
        "`ValueError`, `TypeError` or `RuntimeError`, with a message that says what was wrong and\n"
        "what to do. The table lists bad inputs of the main public functions and a fragment of\n"
        "the message each gets. It is generated from `tests/test_bad_inputs.py`, which runs every\n"
        "row (regenerate it with `OPAKE_WRITE_DOCS=1 pytest tests/test_bad_inputs.py`); wrong\n"
        "argument types of every public constructor are checked in `tests/test_typechecking.py`.\n\n"
        "| Function | Bad input | Error | The message says |\n"
        "| --- | --- | --- | --- |\n" + rows + "\n"
    )


def test_the_docs_page_is_the_table():
    if os.environ.get("OPAKE_WRITE_DOCS"):
        PAGE.write_text(render(), encoding="utf-8")
    assert PAGE.read_text(encoding="utf-8") == render(), "docs/bad-inputs.md is stale: run with OPAKE_WRITE_DOCS=1"
