"""Cross-rank agreement on the public values of a DP step: :func:`agree` and :class:`AgreementCheck`.

Every rank must add the *same* noise (same key, same step) with the *same* multiplier to a
clipped sum of the *same* sensitivity, or the run is not the mechanism the accountant was
told about: a rank with a smaller multiplier is under-noised, and ranks with different
keys hold different parameters afterwards. The noise and psum stages therefore check
these values on every step:

* the first check of a stage gathers every field from every rank and compares them
  (:func:`opake_fx.distributed` consensus: a ``DistributedMismatchError`` on every rank
  naming the field and both values);
* later checks all-reduce one 4-number digest (``max`` of ``(h1, h2, -h1, -h2)``, where
  ``(h1, h2)`` are 26-bit halves of a BLAKE2b hash of the encoded fields): one tiny
  collective per step. Every rank sees the same reduced values, so on a mismatch every
  rank runs the full comparison together and raises the same detailed error.

In one process both are no-ops.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

from opake_fx.distributed._backend import collective_device
from opake_fx.distributed._checks import check_identical
from opake_fx.distributed.collectives import all_reduce_, is_distributed
from opake_fx.errors import DistributedMismatchError, InputTypeError
from opake_fx.random import RngKey
from opake_fx.types import PerGroup

__all__ = ["agree", "AgreementCheck"]

_HALF_BITS = 26  # each hash half is exact in float64 and far from its 53-bit limit


def agree(what: str, fields: Sequence[tuple[str, Any]], *, full: bool, fix: str, device: torch.device | None = None) -> None:
    """Raises ``DistributedMismatchError`` on every rank unless all ranks hold equal ``fields``.

    Args:
        what: the object the fields belong to (named in the error), e.g. ``"noise stage"``.
        fields: ``(name, value)`` pairs; values are ``None``, bools, ints, floats,
            :class:`~opake_fx.random.RngKey` or :class:`~opake_fx.types.PerGroup`.
        full: gather and compare every field (first step); otherwise one all-reduce of a
            digest, followed by the full comparison only if the digests differ.
        fix: the advice appended to the error message.
        device: where the collective runs (default: the backend's device).

    Privacy: none by itself; it refuses to continue a step whose noise would not be the
    accounted mechanism on every rank.

    Example:
        >>> from opake_fx.random import key
        >>> agree("noise", [("key", key(0)), ("step", 3)], full=False, fix="")  # one process: nothing to do
    """
    if not is_distributed():
        return
    if full:
        check_identical(what, fields, fix=fix, device=device)
        return
    h1, h2 = _digest(what, fields)
    device = device if device is not None else collective_device()
    t = torch.tensor([h1, h2, -h1, -h2], dtype=torch.float64, device=device)
    all_reduce_(t, op="max")
    high, low = t[:2].tolist(), (-t[2:]).tolist()
    if high == low:
        return
    # Some rank differs: every rank saw the same reduced digest, so all compare in full together.
    check_identical(what, fields, fix=fix, device=device)
    raise DistributedMismatchError(
        f"{what}: the ranks' values differ (their digests do), but the full comparison found no field that "
        f"differs; a value's encoding is not deterministic across ranks. {fix}"
    )


class AgreementCheck:
    """The per-stage schedule of :func:`agree`: a full check first, then digests.

    A stage holds one of these; the first :meth:`check` in this process is the full
    comparison (also after a restart from a checkpoint), every later one a digest.

    Example:
        >>> check = AgreementCheck("noise stage", fix="Use the same key on every rank.")
        >>> check([("step", 0)])    # one process: nothing to compare
        >>> check.checked
        1
    """

    def __init__(self, what: str, *, fix: str) -> None:
        self.what, self.fix = what, fix
        self.checked = 0

    def __call__(self, fields: Sequence[tuple[str, Any]], *, device: torch.device | None = None) -> None:
        """Checks ``fields`` across ranks (in full the first time, by digest afterwards)."""
        agree(self.what, fields, full=self.checked == 0, fix=self.fix, device=device)
        self.checked += 1


def _digest(what: str, fields: Sequence[tuple[str, Any]]) -> tuple[float, float]:
    h = hashlib.blake2b(what.encode(), digest_size=8)
    for name, value in fields:
        h.update(b"\x00" + name.encode() + b"\x00")
        h.update(_encode(value, f"{what}.{name}"))
    n = int.from_bytes(h.digest(), "little")
    mask = (1 << _HALF_BITS) - 1
    return float(n & mask), float((n >> _HALF_BITS) & mask)


def _encode(value: Any, where: str) -> bytes:
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"B1" if value else b"B0"
    if isinstance(value, RngKey):
        return b"K" + struct.pack("<II", *value.words)
    if isinstance(value, PerGroup):
        items = sorted((repr(k), g) for k, g in value.groups.items())
        vals = sorted(value.values.items())
        return b"P" + repr(items).encode() + b"|" + b"".join(n.encode() + struct.pack("<d", v) for n, v in vals)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, int):
        return b"I" + str(value).encode()
    if isinstance(value, float):
        # ints and floats that compare equal digest alike, as check_identical compares them
        if value.is_integer() and abs(value) < 2**63:
            return b"I" + str(int(value)).encode()
        return b"F" + (b"nan" if math.isnan(value) else struct.pack("<d", value))
    raise InputTypeError(
        f"cannot compare {where} of type {type(value).__name__} across ranks; expected a number, None, "
        "an RngKey or a PerGroup."
    )
