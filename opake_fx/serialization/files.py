"""Checkpoint files: :func:`save_checkpoint` (atomic, checksummed) and :func:`load_checkpoint`.

A file is what ``torch.save`` writes for a dict of plain values and tensors, so
``torch.load(path, weights_only=True)`` reads it and loading can never run code. It
holds the format name and version, one flat dict per named tree (from
:func:`~opake_fx.serialization.state_dict`) and a SHA-256 over all of it, which
:func:`load_checkpoint` recomputes: a truncated or altered file is refused with a
:class:`~opake_fx.errors.CheckpointError` instead of resuming a damaged run.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from opake_fx.errors import CheckpointError, InputValueError
from opake_fx.serialization._ranks import check_shared_state
from opake_fx.serialization.tree import flatten_into, from_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "restore_trees"]

FORMAT = "opake_fx.checkpoint"
VERSION = 1


def save_checkpoint(path: str | os.PathLike[str], **trees: Any) -> None:
    """Writes named trees (params, pipeline state, sampler, accountant, ...) to ``path`` atomically.

    The file is written to a temporary file in the same directory, flushed and
    ``fsync`` ed, then renamed over ``path`` (and the directory is ``fsync`` ed): a
    process killed at any moment leaves either the previous checkpoint or the new one,
    never a mixture. (A kill can leave a stray ``<name>.*.tmp`` file next to it.)

    On several ranks, give every rank its own path (e.g. ``f"ckpt.rank{rank}.pt"``):
    each rank's sampler key and position are its own.

    Args:
        path: the file to write (its directory must exist).
        **trees: the values to save, by name; anything :func:`state_dict` handles.

    Raises:
        InputValueError: no trees were given.
        InputTypeError: a tree holds a value that cannot be saved (naming its path).

    Privacy: the file holds the noise keys and the privacy spent; whoever reads it can
    recompute the noise that was added. Keep it as private as the training data.

    Example:
        >>> import tempfile, torch
        >>> from opake_fx.random import key
        >>> path = tempfile.mkdtemp() + "/ckpt.pt"
        >>> save_checkpoint(path, params={"w": torch.ones(2)}, noise_key=key(7))
        >>> ckpt = load_checkpoint(path, params={"w": torch.zeros(2)}, noise_key=key(0))
        >>> ckpt["params"]["w"].tolist(), ckpt["noise_key"]
        ([1.0, 1.0], RngKey(0, 7))
    """
    if not trees:
        raise InputValueError("save_checkpoint needs at least one named tree, e.g. save_checkpoint(path, params=params).")
    flats: dict[str, dict[str, Any]] = {}
    for name, tree in trees.items():
        flat: dict[str, Any] = {}
        flatten_into(tree, "", flat, copy=False)
        flats[name] = {k: _compact(v) for k, v in flat.items()}
    payload = {"format": FORMAT, "version": VERSION, "trees": flats, "sha256": _digest(flats)}
    _write_atomically(Path(path), payload)


def load_checkpoint(path: str | os.PathLike[str], *, check_ranks: bool = True, **templates: Any) -> dict[str, Any]:
    """Reads the named trees of a :func:`save_checkpoint` file, each rebuilt from its template.

    Args:
        path: the file.
        check_ranks: under ``torch.distributed`` with 2+ ranks, check that every rank
            restored the same shared values (noise keys and steps, adaptive-clipping keys,
            steps and norms); every rank must then call ``load_checkpoint`` together.
        **templates: for each tree to read, a value of its structure (e.g.
            ``state=pipeline.init(params)``); see
            :func:`~opake_fx.serialization.from_state_dict`. Trees in the file that are
            not asked for are not read.

    Returns:
        ``{name: restored tree}`` for every template.

    Raises:
        CheckpointError: no such file; the file is truncated, altered (checksum
            mismatch), not a checkpoint, or holds anything but plain values and tensors
            (refused by ``weights_only`` loading, before anything is imported); a tree is
            missing; or a tree does not fit its template (naming each entry).
        DistributedMismatchError: ranks restored different shared values.

    Privacy: restores keys, steps and the privacy spent exactly, so the resumed run
    neither repeats noise nor forgets spent budget.

    Example:
        >>> import tempfile, torch
        >>> path = tempfile.mkdtemp() + "/ckpt.pt"
        >>> save_checkpoint(path, step=3)
        >>> load_checkpoint(path, step=0)
        {'step': 3}
        >>> load_checkpoint(path, params={"w": torch.zeros(2)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        opake_fx.errors.CheckpointError: ... has no tree 'params' (it has ['step']); save it with save_checkpoint(path, params=...).
    """
    if not templates:
        raise InputValueError("load_checkpoint needs a template per tree to read, e.g. load_checkpoint(path, params=params).")
    out = restore_trees(read_checkpoint(path), os.fspath(path), **templates)
    if check_ranks:
        check_shared_state(out, os.fspath(path))
    return out


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The flat trees of a :func:`save_checkpoint` file, ``{name: {path: leaf}}``, after its checks.

    The file is read with ``weights_only=True`` (nothing imported) and its checksum is
    recomputed; rebuild a tree with :func:`restore_trees` (or
    :func:`~opake_fx.serialization.from_state_dict`).

    Raises:
        CheckpointError: as :func:`load_checkpoint` for the file itself.

    Privacy: the flat trees hold the noise keys; see :func:`save_checkpoint`.

    Example:
        >>> import tempfile
        >>> path = tempfile.mkdtemp() + "/ckpt.pt"
        >>> save_checkpoint(path, step=3)
        >>> read_checkpoint(path)
        {'step': {'': 3}}
    """
    return _read(Path(path))


def restore_trees(flats: Mapping[str, Mapping[str, Any]], where: str, **templates: Any) -> dict[str, Any]:
    """Each template's tree rebuilt from ``flats`` (what :func:`read_checkpoint` returns).

    Raises:
        CheckpointError: a tree is missing or does not fit its template (naming ``where``,
            the tree and each entry).

    Privacy: none by itself (see :func:`~opake_fx.serialization.from_state_dict`).

    Example:
        >>> restore_trees({"step": {"": 3}}, "memory", step=0)
        {'step': 3}
    """
    out: dict[str, Any] = {}
    for name, template in templates.items():
        if name not in flats:
            raise CheckpointError(
                f"{where} has no tree {name!r} (it has {sorted(flats)}); save it with save_checkpoint(path, {name}=...)."
            )
        try:
            out[name] = from_state_dict(template, flats[name])
        except CheckpointError as exc:
            raise CheckpointError(f"{where}, tree {name!r}: {exc}") from None
    return out


# --- private helpers ---------------------------------------------------------------


def _compact(value: Any) -> Any:
    # torch.save writes a tensor's whole storage: a view of a larger buffer is copied out.
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() != value.numel() * value.element_size():
        return value.clone()
    return value


def _digest(flats: Mapping[str, Mapping[str, Any]]) -> str:
    """SHA-256 over a canonical encoding of every entry (name, path, kind, dtype, shape, bytes)."""
    h = hashlib.sha256()

    def piece(data: bytes | memoryview) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    for name in sorted(flats):
        for path in sorted(flats[name]):
            value = flats[name][path]
            piece(name.encode())
            piece(path.encode())
            if isinstance(value, torch.Tensor):
                t = value.detach().to("cpu").contiguous().reshape(-1)
                piece(f"tensor {t.dtype} {tuple(value.shape)}".encode())
                piece(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
            else:
                piece(f"{type(value).__name__} {value!r}".encode())
    return h.hexdigest()


def _write_atomically(path: Path, payload: dict[str, Any]) -> None:
    directory = path.resolve().parent
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _read(path: Path) -> dict[str, dict[str, Any]]:
    where = os.fspath(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {where}.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{where} was refused: it holds something other than plain values and tensors (a class or a "
            f"callable named by import path), which loading would import or run. Nothing was imported. ({exc})"
        ) from None
    except Exception as exc:  # torch raises RuntimeError / EOFError / zip errors for damaged files
        raise CheckpointError(
            f"cannot read {where}: truncated, corrupted, or not a file written by save_checkpoint "
            f"({type(exc).__name__}: {exc})."
        ) from None
    if not (isinstance(data, dict) and data.get("format") == FORMAT):
        raise CheckpointError(f"{where} is not an opake_fx checkpoint (save one with opake_fx.serialization.save_checkpoint).")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{where} has checkpoint format version {data.get('version')!r}; this opake_fx reads {VERSION}.")
    flats = data.get("trees")
    if not (isinstance(flats, dict) and all(isinstance(v, dict) for v in flats.values())):
        raise CheckpointError(f"{where} is damaged: its trees are not flat dicts.")
    try:
        digest = _digest(flats)
    except Exception as exc:
        raise CheckpointError(f"{where} is damaged: its entries cannot be checksummed ({exc}).") from None
    if digest != data.get("sha256"):
        raise CheckpointError(
            f"{where} failed its checksum: the file was altered or corrupted after it was written. "
            "Resume from another checkpoint."
        )
    return flats
