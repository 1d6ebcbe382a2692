"""Privacy accounting: DpProcess algebra, PLD and RDP engines, budgets, calibration, Accountant.

Pure numpy/scipy. Mechanism factories for DP-SGD (``gaussian``, ``poisson``,
``truncated_poisson``, ...) live in :mod:`opake_fx.dpsgd.accounting`; this package holds
what every algorithm shares.

Example:
    >>> import opake_fx.accounting as acc
    >>> import opake_fx.dpsgd.accounting as dpsgd_acc
    >>> training = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), 64 / 10_000) * 500
    >>> round(training.epsilon_at(1e-5), 4)
    0.8246
"""

from opake_fx.accounting import mechanisms
from opake_fx.accounting.accountant import Accountant
from opake_fx.accounting.budgets import (
    Budget,
    DeltaBudget,
    EpsilonBudget,
    budget_from_dict,
    delta_budget,
    epsilon_budget,
)
from opake_fx.accounting.calibrate import PARAMETER_RANGES, CalibrateResult, calibrate
from opake_fx.accounting.group import group_delta, group_epsilon, group_rdp
from opake_fx.accounting.mechanisms import (
    AdaptiveClippingGaussian,
    EpsDelta,
    Gaussian,
    Laplace,
    PoissonSampled,
    SampledWithoutReplacement,
    TruncatedPoissonSampled,
    eps_delta,
)
from opake_fx.accounting.incremental import IncrementalPld
from opake_fx.accounting.pld import DEFAULT_DISCRETIZATION, PrivacyLossDistribution, clear_caches
from opake_fx.accounting.process import (
    ADD_OR_REMOVE_ONE,
    REPLACE_ONE,
    Composed,
    DpProcess,
    Identity,
    NonPrivate,
    Repeated,
    compose,
    identity,
    nonprivate,
    process_from_dict,
    repeat,
)
from opake_fx.accounting.rdp import DEFAULT_RDP_ORDERS

__all__ = [
    "group_delta",
    "group_epsilon",
    "group_rdp",
    "DpProcess",
    "identity",
    "nonprivate",
    "eps_delta",
    "compose",
    "repeat",
    "process_from_dict",
    "epsilon_budget",
    "delta_budget",
    "budget_from_dict",
    "Budget",
    "EpsilonBudget",
    "DeltaBudget",
    "calibrate",
    "CalibrateResult",
    "PARAMETER_RANGES",
    "Accountant",
    "PrivacyLossDistribution",
    "IncrementalPld",
    "clear_caches",
    "DEFAULT_DISCRETIZATION",
    "DEFAULT_RDP_ORDERS",
    "ADD_OR_REMOVE_ONE",
    "REPLACE_ONE",
    "Identity",
    "NonPrivate",
    "Repeated",
    "Composed",
    # the mechanism classes, in the order mechanisms lists them
    *(name for name in mechanisms.__all__ if isinstance(getattr(mechanisms, name), type)),
]
