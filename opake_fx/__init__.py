"""opake_fx: functional, JAX-style differentially private training for PyTorch.

The top level re-exports only the core verbs; everything else is imported from its
topic (``opake_fx.dpsgd.clipping``, ``opake_fx.accounting``, ``opake_fx.distributed``...).
"""

from opake_fx.errors import OpakeError
from opake_fx.random import RngKey, fold_in, key, split
from opake_fx.transforms import Transform, apply_updates, chain, named_chain
from opake_fx.types import ClippedPytree, NoisedPytree, PerGroup

__version__ = "0.1.0"

__all__ = [
    "OpakeError",
    "RngKey",
    "key",
    "split",
    "fold_in",
    "Transform",
    "chain",
    "named_chain",
    "apply_updates",
    "ClippedPytree",
    "NoisedPytree",
    "PerGroup",
]
