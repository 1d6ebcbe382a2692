"""Cross-rank consensus on public values (clip norms, noise keys, steps, tree structure).

Values are encoded as float64 vectors, all-gathered on the backend's device (CUDA for
nccl, CPU otherwise), decoded and compared on every rank. Every rank sees the same rows,
so a mismatch raises the same :class:`~opake_fx.errors.DistributedMismatchError` on all
of them and the group stays usable (no rank is left waiting in a collective).

Encodings are self-describing so that a rank holding ``None`` where another holds a
float still decodes cleanly. Integers are exact up to ``2**53``; ``uint32`` key words and
step counters are far below that.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from opake_fx.distributed._backend import collective_device, run_collective
from opake_fx.distributed.collectives import get_world_size
from opake_fx.errors import DistributedMismatchError, InputTypeError
from opake_fx.random import RngKey
from opake_fx.types import PerGroup

_NONE, _NUM, _PERGROUP, _KEY, _BOOL = 0.0, 1.0, 2.0, 3.0, 4.0


@dataclass(frozen=True)
class _PerGroupView:
    """A PerGroup seen through the wire: its assignment fingerprint and sorted values."""

    assignment: int
    names_crc: int
    values: tuple[float, ...]


def fingerprint(obj: Any) -> int:
    """A stable 32-bit fingerprint of ``repr(obj)`` (for structures, names, dtypes)."""
    return zlib.crc32(repr(obj).encode())


def gather_float_rows(values: Sequence[float], *, device: torch.device | None = None) -> list[list[float]]:
    """All-gathers a variable-length list of floats from every rank (rank order).

    Two collectives: the lengths, then the values padded to the longest.
    """
    device = device if device is not None else collective_device()
    n = torch.tensor([float(len(values))], dtype=torch.float64, device=device)
    lengths = _all_gather(n, "gather lengths")
    longest = int(max(float(t.item()) for t in lengths))
    buf = torch.full((max(longest, 1),), math.nan, dtype=torch.float64, device=device)
    if values:
        buf[: len(values)] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    rows = _all_gather(buf, "gather values")
    return [r[: int(k.item())].tolist() for r, k in zip(rows, lengths)]


def gather_fields(what: str, fields: Sequence[tuple[str, Any]], *, device: torch.device | None = None) -> list[list[Any]]:
    """All-gathers the decoded values of ``fields`` from every rank.

    Returns one list of decoded values per rank. The first check is that every rank
    gathered the same kind of object (``what``) with the same field names; if not, every
    rank raises DistributedMismatchError.
    """
    header = [float(fingerprint((what, [name for name, _ in fields])))]
    flat = header + [x for name, value in fields for x in _encode(value, f"{what}.{name}")]
    rows = gather_float_rows(flat, device=device)
    if any(row[:1] != rows[0][:1] for row in rows):
        raise DistributedMismatchError(
            f"ranks disagree on what they synchronise at this point: rank {_rank()} gathered {what} with fields "
            f"{[n for n, _ in fields]}, other ranks gathered something else. Every rank must call the same "
            "distributed functions in the same order with the same kinds of values (e.g. sync(clip_state, "
            "noise_state) everywhere, and ClippedPytree on every rank or on none)."
        )
    return [_decode_all(row[1:], len(fields)) for row in rows]


def check_identical(
    what: str,
    fields: Sequence[tuple[str, Any]],
    *,
    fix: str,
    device: torch.device | None = None,
) -> list[list[Any]]:
    """Raises DistributedMismatchError on every rank unless all ranks hold equal ``fields``.

    ``what`` names the object (``"GaussianNoiseState"``); each field is ``(name, value)``
    with a value that is ``None``, a bool, an int, a float, an :class:`RngKey` or a
    :class:`PerGroup`. Floats must be exactly equal (NaN equals NaN). ``fix`` is the
    advice appended to the message. Returns the gathered rows.
    """
    rows = gather_fields(what, fields, device=device)
    local = rows[_rank()]
    for i, (name, value) in enumerate(fields):
        column = [row[i] for row in rows]
        if all(_same(column[0], c) for c in column[1:]):
            continue
        other = next(r for r, c in enumerate(column) if not _same(column[0], c))
        raise DistributedMismatchError(
            f"{what}.{name} differs across ranks: rank 0 has {_show(column[0], value, local[i])}, "
            f"rank {other} has {_show(column[other], value, local[i])}. It must be identical on every rank. {fix}"
        )
    return rows


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather(t: torch.Tensor, name: str) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(get_world_size())]
    run_collective(f"consensus check ({name})", dist.all_gather, out, t)
    return out


def _encode(value: Any, where: str) -> list[float]:
    if value is None:
        return [_NONE]
    if isinstance(value, bool):
        return [_BOOL, float(value)]
    if isinstance(value, RngKey):
        return [_KEY, float(value.words[0]), float(value.words[1])]
    if isinstance(value, PerGroup):
        names = sorted(value.values)
        return [
            _PERGROUP,
            float(len(names)),
            float(fingerprint(sorted(value.groups.items(), key=repr))),
            float(fingerprint(names)),
            *(value.values[n] for n in names),
        ]
    if isinstance(value, (int, float)):
        return [_NUM, float(value)]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return [_NUM, float(value.item())]
    raise InputTypeError(
        f"cannot compare {where} of type {type(value).__name__} across ranks; expected a number, None, "
        "an RngKey or a PerGroup."
    )


def _decode_all(row: list[float], count: int) -> list[Any]:
    out: list[Any] = []
    i = 0
    for _ in range(count):
        tag = row[i]
        if tag == _NONE:
            out.append(None)
            i += 1
        elif tag == _BOOL:
            out.append(bool(row[i + 1]))
            i += 2
        elif tag == _NUM:
            out.append(row[i + 1])
            i += 2
        elif tag == _KEY:
            out.append(RngKey((int(row[i + 1]), int(row[i + 2]))))
            i += 3
        else:  # _PERGROUP
            n = int(row[i + 1])
            out.append(_PerGroupView(int(row[i + 2]), int(row[i + 3]), tuple(row[i + 4 : i + 4 + n])))
            i += 4 + n
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def _show(decoded: Any, local_value: Any, local_decoded: Any) -> str:
    """Renders a gathered value, with the local group names when the assignment matches."""
    if isinstance(decoded, _PerGroupView):
        if isinstance(local_value, PerGroup) and isinstance(local_decoded, _PerGroupView) and (
            decoded.names_crc == local_decoded.names_crc and len(decoded.values) == len(local_value.values)
        ):
            shown = dict(zip(sorted(local_value.values), decoded.values))
            suffix = "" if decoded.assignment == local_decoded.assignment else " with a different leaf assignment"
            return f"PerGroup({shown}){suffix}"
        return f"PerGroup(values={list(decoded.values)}) over other groups"
    if isinstance(decoded, float) and decoded.is_integer() and abs(decoded) < 2**53 and isinstance(local_value, int):
        return str(int(decoded))
    return repr(decoded)
