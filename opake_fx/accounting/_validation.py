"""Former home of the accounting modules' argument checks (private; kept as an alias).

The checks now live in the public :mod:`opake_fx.validation`, shared by the whole
library; this alias keeps ``from opake_fx.accounting import _validation as check``
working in the modules not yet moved onto it. New code imports
``from opake_fx import validation as check``.
"""

from __future__ import annotations

from opake_fx.validation import delta, integer, non_negative, positive, real, unit_interval

__all__ = ["real", "positive", "non_negative", "unit_interval", "delta", "integer"]
