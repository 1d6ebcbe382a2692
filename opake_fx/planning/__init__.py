"""The parts a :class:`~opake_fx.plan.DPPlan` composes: sampling, mechanism, clip mode.

A plan is plain data (``DPPlan(sampling="poisson", mechanism="gaussian",
clipping_mode="fixed", ...)``); each name is looked up in its registry and the object
found owns everything about that part:

* :mod:`opake_fx.planning.samplers` (:data:`~opake_fx.planning.samplers.SAMPLING`): the
  batch sampler of a rank's shard, the participation pattern, the amplification of one
  opportunity;
* :mod:`opake_fx.planning.mechanisms` (:data:`~opake_fx.planning.mechanisms.MECHANISMS`):
  the noise stage, the cost of one unamplified opportunity or of the whole run;
* :mod:`opake_fx.planning.clip_modes` (:data:`~opake_fx.planning.clip_modes.CLIP_MODES`):
  the clip stage, its options, and what one step releases beside the gradient.

The plan itself only composes them (:attr:`DPPlan.parts <opake_fx.plan.DPPlan.parts>`):
a run's cost is the sampling part's amplification of the mechanism's opportunity, once
per opportunity, or, for unamplified schemes, the mechanism's whole run. Which pairs go
together follows from the sampling part's accounting kind and the kinds the mechanism
accounts. :class:`~opake_fx.planning.key_roles.KeyRoles` is the ledger of the keys a
plan's sampler and pipelines were built with.

Example:
    >>> from opake_fx.plan import DPPlan
    >>> plan = DPPlan(dataset_size=1000, batch_size=10, steps=100, noise_multiplier=1.0, delta=1e-5)
    >>> parts = plan.parts
    >>> parts.sampling.name, parts.mechanism.name, parts.clip_mode.name
    ('poisson', 'gaussian', 'fixed')
    >>> parts.sampling.amplify(plan, parts.mechanism.opportunity(plan, 1.0)) == plan.step_cost
    True
"""
