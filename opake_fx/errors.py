"""The error hierarchy of opake_fx.

Every error the library raises on purpose is an :class:`OpakeError`. Each concrete
class also derives from the matching builtin (``ValueError``, ``TypeError``,
``RuntimeError``) so that ``except ValueError`` in user code keeps working.

Messages say what was wrong, what was received, and what to do instead. A
privacy-relevant misuse (noise on an unclipped gradient, mismatched noise keys across
ranks, an exceeded budget) is always an error, never a warning.
"""

from __future__ import annotations

__all__ = [
    "OpakeError",
    "InputValueError",
    "InputTypeError",
    "OperationError",
    "NoiseInputError",
    "CalibrationError",
    "BudgetExceededError",
    "DistributedMismatchError",
    "CheckpointError",
    "CheckpointRanksError",
    "SlowPathWarning",
]


class OpakeError(Exception):
    """Base class of every error raised by opake_fx."""


class InputValueError(OpakeError, ValueError):
    """An argument has the right type but an invalid value."""


class InputTypeError(OpakeError, TypeError):
    """An argument has the wrong type."""


class OperationError(OpakeError, RuntimeError):
    """An operation cannot run in the current state (e.g. no process group)."""


class NoiseInputError(InputTypeError):
    """A noise stage was given something other than a clipped gradient."""


class CalibrationError(OpakeError, ValueError):
    """A calibration bracket contains no parameter that meets the budget."""


class BudgetExceededError(OpakeError, RuntimeError):
    """Taking another step would spend more privacy than the budget allows."""


class DistributedMismatchError(OpakeError, RuntimeError):
    """Ranks disagree on a value that must be identical everywhere (noise key, step, max_norm)."""


class CheckpointError(OpakeError, ValueError):
    """A checkpoint does not fit its template, or its file is truncated, altered or not a checkpoint.

    The message names the entry (its path, e.g. ``"state/opt/mu/w"``) or the file, and
    what to do. Nothing is restored when it is raised.
    """


class CheckpointRanksError(CheckpointError, DistributedMismatchError):
    """The ranks resumed from checkpoints that are not one step of one run (raised on every rank).

    Both a :class:`CheckpointError` (a checkpoint was refused) and a
    :class:`DistributedMismatchError` (the ranks disagree); the message names the
    disagreeing value or the rank whose checkpoint was refused.
    """


class SlowPathWarning(UserWarning):
    """A computation took an exact but much slower path; the message says why and how to avoid it.

    Only for speed: nothing privacy-relevant is ever a warning.
    """
