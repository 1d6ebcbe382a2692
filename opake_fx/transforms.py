"""Pure transforms and their composition (the optax contract, for torch).

A :class:`Transform` is a pair of pure functions::

    init(params) -> state
    update(x, state, params=None, **extra) -> (out, state)

Nothing is mutated and nothing lives in a module or a global RNG: all state is the
value returned next to the output. Unknown keyword arguments are accepted and ignored,
so one ``update`` call can feed every stage of a :func:`chain`; a stage that needs an
extra declares it keyword-only.

DP pipelines are chains whose stages exchange typed values: ``clip`` emits a
:class:`~opake_fx.types.ClippedPytree`, ``psum`` keeps it one, ``noise`` accepts only
that and emits a :class:`~opake_fx.types.NoisedPytree`, and optimizers accept either.
The privacy ordering (clip, aggregate, noise) is therefore enforced by types.

Example:
    >>> import torch
    >>> from opake_fx.optimizers import sgd
    >>> t = chain(stateless(lambda g, params=None: [2 * x for x in g]), sgd(0.1))
    >>> params = [torch.ones(2)]
    >>> updates, state = t.update([torch.ones(2)], t.init(params), params)
    >>> apply_updates(params, updates)[0].tolist()
    [0.800000011920929, 0.800000011920929]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from opake_fx.errors import InputTypeError, InputValueError
from opake_fx.pipeline_privacy import PrivacyReport, StagePrivacy, check_stage_order, privacy_report
from opake_fx.pytree import tree_map
from opake_fx.types import ClippedPytree, EmptyState
from opake_fx.typing import typechecked

__all__ = ["Transform", "chain", "named_chain", "identity", "stateless", "apply_updates", "unwrap"]


class Transform(NamedTuple):
    """A pure stage: ``init(params) -> state`` and ``update(x, state, params=None, **extra) -> (out, state)``.

    ``privacy`` describes what the stage does to privacy (a
    :class:`~opake_fx.pipeline_privacy.StagePrivacy`; ``None`` for stages that do not
    say): :func:`chain` checks the stage order with it, and :meth:`privacy_report`
    reports it.
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    privacy: StagePrivacy | None = None

    def privacy_report(
        self, *, sample_rate: float | None = None, steps: int | None = None, delta: float | None = None
    ) -> PrivacyReport:
        """The stage-by-stage privacy of this transform (see :func:`opake_fx.pipeline_privacy.privacy_report`).

        Privacy: reading only.

        Example:
            >>> from opake_fx.optimizers import sgd
            >>> chain(sgd(0.1)).privacy_report().private   # no clip, no noise
            False
        """
        stages = self.privacy.stages if self.privacy is not None and self.privacy.kind == "chain" else (("0", self.privacy),)
        return privacy_report(stages, sample_rate=sample_rate, steps=steps, delta=delta)


def identity() -> Transform:
    """Passes its input through unchanged.

    Privacy: post-processing; changes no guarantee.
    """

    def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return x, state

    return Transform(lambda params: EmptyState(), update)


@typechecked
def stateless(fn: Callable[..., Any]) -> Transform:
    """Wraps ``fn(x, params=None)`` as a stateless :class:`Transform`.

    Privacy: whatever ``fn`` does; a function of a noised value and public data only is
    post-processing.
    """

    def update(x: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return fn(x, params=params), state

    return Transform(lambda params: EmptyState(), update)


@typechecked
def chain(*transforms: Transform) -> Transform:
    """Composes transforms left to right; the state is the tuple of their states.

    Privacy: the chain's guarantee is that of its mechanisms (the noise stages); the
    typed values between stages make a noise stage refuse unclipped input. Building a
    chain whose clip stage reaches an optimizer without a noise stage in between, or with
    a gradient stage before clip, raises ``OperationError``
    (:func:`opake_fx.pipeline_privacy.check_stage_order`); a non-private baseline uses
    ``noise(noise_multiplier=0, ...)``. ``chain(...).privacy_report()`` reports it.

    Raises:
        InputTypeError: an argument is not a ``Transform``.
        OperationError: the stage order breaks clip -> (psum) -> noise -> optimizer.
    """
    for i, t in enumerate(transforms):
        _check_transform(t, f"chain argument {i}")
    described = tuple((str(i), t.privacy) for i, t in enumerate(transforms))
    check_stage_order(described, "chain")

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(x: Any, state: tuple[Any, ...], params: Any = None, **extra: Any) -> tuple[Any, tuple[Any, ...]]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise InputValueError(
                f"chain of {len(transforms)} stages got a state of {type(state).__name__}"
                f"{'' if not isinstance(state, tuple) else f' with {len(state)} entries'}; "
                "pass the state returned by this chain's init or previous update."
            )
        new_states = []
        for t, s in zip(transforms, state):
            x, s = t.update(x, s, params, **extra)
            new_states.append(s)
        return x, tuple(new_states)

    return Transform(init, update, StagePrivacy("chain", stages=described))


@typechecked
def named_chain(*named: tuple[str, Transform]) -> Transform:
    """Like :func:`chain`, with named stages; the state is a ``dict`` name -> state.

    Names make states easy to find (``state["noise"]``) and to checkpoint, and name the
    rows of ``privacy_report()``. The stage order is checked as by :func:`chain`.

    Example:
        >>> from opake_fx.optimizers import sgd
        >>> t = named_chain(("id", identity()), ("opt", sgd(1.0)))
        >>> sorted(t.init(None))
        ['id', 'opt']
    """
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise InputValueError(f"named_chain stage names must be unique; got {names}.")
    for name, t in named:
        if not isinstance(name, str):
            raise InputTypeError(f"named_chain takes (name, transform) pairs; got name {name!r}.")
        _check_transform(t, f"named_chain stage {name!r}")
    described = tuple((name, t.privacy) for name, t in named)
    check_stage_order(described, "named_chain")

    def init(params: Any) -> dict[str, Any]:
        return {name: t.init(params) for name, t in named}

    def update(x: Any, state: dict[str, Any], params: Any = None, **extra: Any) -> tuple[Any, dict[str, Any]]:
        if not isinstance(state, dict) or list(state) != names:
            raise InputValueError(
                f"named_chain with stages {names} got a state with keys "
                f"{list(state) if isinstance(state, dict) else type(state).__name__}; pass the state "
                "returned by this chain's init or previous update."
            )
        new_state = {}
        for name, t in named:
            x, new_state[name] = t.update(x, state[name], params, **extra)
        return x, new_state

    return Transform(init, update, StagePrivacy("chain", stages=described))


def unwrap(tree: Any) -> Any:
    """The raw pytree inside a DP wrapper (``ClippedPytree``/``NoisedPytree``), else ``tree``."""
    return tree.pytree if isinstance(tree, ClippedPytree) else tree


def apply_updates(params: Any, updates: Any) -> Any:
    """Returns ``params + updates`` leafwise (new tensors; ``params`` is not modified).

    ``updates`` may be a DP wrapper; its ``.pytree`` is used. Each update is cast to
    its parameter's dtype.

    Privacy: post-processing.
    """
    updates = unwrap(updates)
    return tree_map(lambda p, u: p + u.to(p.dtype), params, updates)


def _check_transform(t: Any, where: str) -> None:
    if not isinstance(t, Transform):
        raise InputTypeError(
            f"{where} is a {type(t).__name__}, not a Transform. Stages are built by functions "
            "such as opake_fx.dpsgd.clip(...), opake_fx.dpsgd.noise(...) or opake_fx.optimizers.sgd(...)."
        )


