"""The messages between the kernel and its ranks, and how values cross the wire.

Every message is a tuple whose first item names its kind, pickled with the standard
:mod:`pickle` (never :mod:`multiprocessing`'s reducer, which would try to share tensor
memory through file descriptors a socket cannot carry) and sent with
``Connection.send_bytes`` over an authenticated loopback connection.

Kernel -> rank::

    ("exec", job, code, filename)     run a cell in the rank's namespace
    ("pull", job, name)               send back the value of ``name``
    ("call", job, payload)            payload: pickled (fn, args, kwargs); send back fn's result
    ("stop",)                         leave the process group and exit

Rank -> kernel::

    ("hello", rank, world_size, local_rank, pid)   connected (before the process group)
    ("ready", backend, device)                      process group initialised
    ("out", job, stream, text)                      stdout/stderr written by a cell
    ("done", job, payload)                          job finished; payload: pickled value or None
    ("error", job, type_name, message, traceback_text)
"""

from __future__ import annotations

import io
import pickle
from typing import Any

#: Environment variables by which the kernel tells its workers where and how to connect.
ENV_ADDRESS = "OPAKE_FX_NOTEBOOK_ADDRESS"
ENV_AUTHKEY = "OPAKE_FX_NOTEBOOK_AUTHKEY"
ENV_KERNEL_PID = "OPAKE_FX_NOTEBOOK_KERNEL_PID"
ENV_BACKEND = "OPAKE_FX_NOTEBOOK_BACKEND"
ENV_PG_TIMEOUT = "OPAKE_FX_NOTEBOOK_PG_TIMEOUT"

#: The worker's module, as run by torchrun (``-m``); also how stray workers are recognised.
WORKER_MODULE = "opake_fx.notebook._worker"


def encode(message: tuple) -> bytes:
    """Pickles a protocol message (plain tuples of str/int/bytes/None)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> tuple:
    """Unpickles a protocol message."""
    return pickle.loads(data)


class _HostPickler(pickle.Pickler):
    """Pickles tensors as CPU tensors, so unpickling never touches a GPU in the kernel."""

    def reducer_override(self, obj: Any) -> Any:
        torch = _torch_if_loaded()
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _torch_if_loaded() -> Any:
    import sys

    return sys.modules.get("torch")


def dump_value(value: Any) -> bytes:
    """Pickles a value for the kernel; tensors on any device arrive as CPU tensors."""
    buf = io.BytesIO()
    _HostPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def dump_call(fn: Any, args: tuple, kwargs: dict) -> bytes:
    """Pickles a function call for the ranks.

    Module-level functions are pickled by reference (the ranks import them: they see the
    kernel's ``sys.path``); functions defined in ``__main__`` (a notebook, a script) are
    pickled by value with cloudpickle when it is installed.
    """
    if getattr(fn, "__module__", None) == "__main__":
        try:
            import cloudpickle
        except ImportError:  # pragma: no cover - cloudpickle is in the notebook extra
            pass
        else:
            return cloudpickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
