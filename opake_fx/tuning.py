"""Hyperparameter guidance for DP-SGD, and a sweep helper that charges for tuning.

The rules the literature gives, as functions:

* **Noise-to-signal.** With the clipped sum divided by the batch size ``B``, the noise on
  each averaged gradient has standard deviation ``sigma * C / B``; at a fixed number of
  steps, utility is governed by ``sigma / B`` (Sander, Stock & Sablayrolles 2023, "TAN
  without a burn: scaling laws of DP-SGD", ICML: the "total amount of noise"). At a fixed
  epsilon and step count, a larger batch needs a larger ``sigma`` but less than in
  proportion, so ``sigma / B`` falls: large batches help (De et al. 2022, "Unlocking
  high-accuracy differentially private image classification through scale", section 4;
  Ponomareva et al. 2023, "How to DP-fy ML", section 5.4: use the largest batch the
  compute budget allows).
* **Learning rate.** Runs with the same steps and the same ``sigma / B`` see the same
  update noise and the same expected gradient, so a learning rate tuned at one batch size
  transfers unchanged (Sander et al. 2023, who tune at small batches with the noise
  scaled to keep ``sigma / B`` and then train once at the large batch). With the epochs
  fixed instead, ``B`` times larger batches make ``B`` times fewer steps, and the linear
  scaling rule (Goyal et al. 2017, "Accurate, large minibatch SGD") multiplies the
  learning rate by the same factor, keeping the distance travelled per epoch.

:func:`suggest` applies them to a compute budget and a target epsilon. :func:`sweep`
runs a small grid and charges the privacy of every trial: **tuning on private data
costs privacy** — the chosen configuration, and the model trained with it, depend on
every trial's run — unless the trials use public data (or a proxy). The sweep composes
the trials' processes (selection is post-processing of all of them); a tighter analysis
for a random number of trials exists (Papernot & Steinke 2022, "Hyperparameter tuning
with Renyi differential privacy") and is not implemented here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.typing import typechecked

__all__ = ["BatchChoice", "Suggestion", "SweepResult", "batch_choices", "suggest", "sweep"]


@dataclass(frozen=True)
class BatchChoice:
    """One candidate batch size at the budget: its steps, calibrated sigma, ``sigma / B`` and
    ``sigma / sqrt(B)`` (the noise accumulated per epoch when the learning rate scales with ``B``)."""

    batch_size: int
    steps: int
    epochs: float
    noise_multiplier: float
    noise_to_signal: float
    noise_per_epoch: float


@dataclass(frozen=True)
class Suggestion:
    """The batch size and learning rate :func:`suggest` picks, with the candidates it weighed.

    Attributes:
        batch_size, steps, epochs, noise_multiplier, noise_to_signal: of the chosen batch.
        learning_rate: the base learning rate scaled by the rule (None without a base).
        rule: one line saying which rule set the learning rate.
        candidates: every :class:`BatchChoice` considered.
    """

    batch_size: int
    steps: int
    epochs: float
    noise_multiplier: float
    noise_to_signal: float
    learning_rate: float | None
    rule: str
    candidates: tuple[BatchChoice, ...]


@typechecked
def batch_choices(dataset_size: int, *, target_epsilon: float, delta: float, batch_sizes: Sequence[int],
                  epochs: float | None = None, steps: int | None = None) -> list[BatchChoice]:
    """Calibrates sigma for each batch size at a fixed budget of ``epochs`` or of ``steps``.

    Each candidate is a :class:`~opake_fx.plan.DPPlan` (Poisson sampling, PLD accounting):
    with ``epochs`` fixed its steps are ``epochs * N / B``; with ``steps`` fixed its epochs
    are ``steps * B / N``.

    Privacy: reads no data (the accounting of hypothetical runs).

    Example:
        >>> [round(c.noise_to_signal, 4) for c in batch_choices(1437, target_epsilon=3.0, delta=1e-5,
        ...                                                     batch_sizes=[128, 512], steps=225)]
        [0.0162, 0.0147]
    """
    if (epochs is None) == (steps is None):
        raise InputValueError("batch_choices needs exactly one of epochs (fixed compute) or steps (fixed step count).")
    out = []
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b < dataset_size:
            raise InputValueError(f"batch sizes must be ints in [1, dataset_size={dataset_size}); got {b!r}.")
        out.append(_choice(dataset_size, b, float(target_epsilon), float(delta), epochs, steps))
    return out


@functools.lru_cache(maxsize=256)
def _choice(dataset_size: int, b: int, target_epsilon: float, delta: float, epochs: float | None,
            steps: int | None) -> BatchChoice:
    from opake_fx.plan import DPPlan

    kw: dict[str, Any] = {"epochs": epochs} if epochs is not None else {"steps": steps}
    plan = DPPlan(dataset_size=dataset_size, batch_size=b, clipping_norm=1.0, target_epsilon=target_epsilon,
                  delta=delta, **kw)
    z = plan.noise_multiplier
    return BatchChoice(b, plan.steps, plan.epochs, z, z / b, z / math.sqrt(b))


@typechecked
def suggest(dataset_size: int, *, target_epsilon: float, delta: float, epochs: float | None = None,
            steps: int | None = None, base_batch_size: int | None = None, base_learning_rate: float | None = None,
            batch_sizes: Sequence[int] | None = None, min_steps: int = 100) -> Suggestion:
    """Picks the batch size with the least noise at the budget, and scales a base learning rate to it.

    Fix the compute either as ``steps`` (epochs grow with ``B``): the smallest ``sigma / B``
    wins and the learning rate transfers unchanged (Sander et al. 2023); or as ``epochs``
    (steps fall as ``B`` grows): the learning rate scales linearly with ``B`` (Goyal et al.
    2017), the noise the run accumulates is then proportional to ``lr * sqrt(steps) *
    sigma / B``, i.e. to ``sigma / sqrt(B)``, and the smallest of that wins. The
    candidates (default: powers of two from 16 below ``dataset_size / 2``) keep at least
    ``min_steps`` steps: with too few steps the model does not train, whatever the noise.

    Args:
        dataset_size: number of training examples.
        target_epsilon, delta: the budget.
        epochs, steps: exactly one: the fixed compute budget.
        base_batch_size, base_learning_rate: a learning rate known to work at a batch size
            (e.g. from public data or a non-private run); both or neither.
        batch_sizes: the candidates.
        min_steps: the fewest steps a candidate may have.

    Privacy: reads no data. The base learning rate must not come from tuning on the
    private data (or that tuning must be charged: :func:`sweep`).

    Example:
        >>> s = suggest(1437, target_epsilon=3.0, delta=1e-5, steps=225, base_batch_size=128, base_learning_rate=0.1,
        ...             batch_sizes=[128, 512])
        >>> s.batch_size, s.learning_rate, round(s.epochs)
        (512, 0.1, 80)
    """
    if (base_batch_size is None) != (base_learning_rate is None):
        raise InputValueError("suggest needs base_batch_size and base_learning_rate together (or neither).")
    if batch_sizes is None:
        batch_sizes = [2 ** k for k in range(4, 30) if 2 ** k < dataset_size / 2]
    candidates = batch_choices(dataset_size, target_epsilon=target_epsilon, delta=delta, batch_sizes=batch_sizes,
                               epochs=epochs, steps=steps)
    usable = [c for c in candidates if c.steps >= min_steps]
    if not usable:
        raise InputValueError(
            f"no candidate batch size keeps {min_steps} steps at this budget (largest step count "
            f"{max(c.steps for c in candidates)}); give more epochs, smaller batch_sizes, or a lower min_steps."
        )
    best = min(usable, key=lambda c: (c.noise_to_signal if steps is not None else c.noise_per_epoch, -c.batch_size))
    lr, rule = None, "no base learning rate given"
    if base_batch_size is not None:
        if steps is not None:
            lr = float(base_learning_rate)
            rule = (f"steps fixed: learning rate {lr:g} unchanged from batch {base_batch_size} "
                    "(same steps, lower sigma/B; Sander et al. 2023)")
        else:
            lr = float(base_learning_rate) * best.batch_size / base_batch_size
            rule = (f"epochs fixed: learning rate {base_learning_rate:g} x {best.batch_size}/{base_batch_size} = {lr:g} "
                    "(linear scaling, Goyal et al. 2017)")
    return Suggestion(best.batch_size, best.steps, best.epochs, best.noise_multiplier, best.noise_to_signal, lr, rule,
                      tuple(candidates))


@dataclass(frozen=True)
class SweepResult:
    """What :func:`sweep` found and what it cost.

    Attributes:
        best: the configuration with the highest score.
        best_score: its score.
        scores: ``(config, score)`` for every trial, in order.
        privacy_cost: the composition of every trial's process (what an accountant must
            charge for the tuning), or ``None`` when the trials used public data.
    """

    best: Any
    best_score: float
    scores: tuple[tuple[Any, float], ...]
    privacy_cost: Any


def sweep(trial: Callable[[Any], float], configs: Sequence[Any], *, public_data: bool = False,
          trial_cost: Any = None) -> SweepResult:
    """Runs ``trial(config) -> score`` (higher is better) for each configuration and returns the best.

    **Tuning on private data costs privacy.** Every trial trains on the data, and the
    chosen configuration (and anything trained with it) depends on all of them. So the
    sweep needs either ``public_data=True`` (the trials train and score on public data or
    a public proxy, and nothing is charged) or ``trial_cost``, the
    :class:`~opake_fx.accounting.DpProcess` of one trial (e.g. ``plan.step_cost *
    plan.steps``; the process of each trial if they differ, as a sequence): the sweep
    returns their composition as ``privacy_cost`` — charge it with the final run's cost.
    Scores must come from the trials' private outputs or from held-out data treated the
    same way.

    Raises:
        InputValueError: neither ``public_data=True`` nor ``trial_cost`` was given (or both).

    Example:
        >>> import opake_fx.dpsgd.accounting as dpsgd_acc
        >>> step = dpsgd_acc.poisson(dpsgd_acc.gaussian(2.0), 0.1)
        >>> r = sweep(lambda lr: -abs(lr - 0.1), [0.05, 0.1, 0.2], trial_cost=step * 100)
        >>> r.best, round(r.privacy_cost.epsilon_at(1e-5), 2) > round((step * 100).epsilon_at(1e-5), 2)
        (0.1, True)
    """
    from opake_fx.accounting import compose

    if not callable(trial):
        raise InputTypeError(f"sweep needs trial(config) -> score to be callable; got {type(trial).__name__}.")
    configs = list(configs)
    if not configs:
        raise InputValueError("sweep needs at least one configuration.")
    if public_data == (trial_cost is not None):
        raise InputValueError(
            "sweep needs to know what tuning costs: tuning on private data costs privacy (the chosen configuration "
            "depends on every trial). Pass trial_cost=<the DpProcess of one trial> to get the composed cost of all "
            "trials, or public_data=True if the trials train and score on public data only (not both)."
        )
    scores = []
    for c in configs:
        s = float(trial(c))
        if math.isnan(s):
            raise InputValueError(f"sweep: trial({c!r}) returned NaN.")
        scores.append((c, s))
    best, best_score = max(scores, key=lambda cs: cs[1])
    cost = None
    if trial_cost is not None:
        costs = list(trial_cost) if isinstance(trial_cost, (list, tuple)) else [trial_cost] * len(configs)
        if len(costs) != len(configs):
            raise InputValueError(f"sweep: {len(costs)} trial costs for {len(configs)} configurations.")
        cost = compose(*costs)
    return SweepResult(best, best_score, tuple(scores), cost)
