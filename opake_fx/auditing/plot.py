"""A notebook plot of an audit: the attack's ROC curve and the lower bounds against the claim.

matplotlib is imported when the function is called (it is not a dependency of opake_fx).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opake_fx.errors import InputTypeError

__all__ = ["plot_audit"]


def plot_audit(result: Any, *, axes: Any = None) -> Any:
    """Draws the ROC curve (log-log) and the epsilon lower bounds next to the accountant's epsilon.

    Args:
        result: an :class:`~opake_fx.auditing.AuditResult`, or a
            :class:`~opake_fx.auditing.CanaryScoreAuditor` (ROC only).
        axes: two matplotlib axes to draw on (default: a new 1x2 figure).

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    from opake_fx.auditing.dpsgd import AuditResult
    from opake_fx.auditing.two_sample import CanaryScoreAuditor

    if isinstance(result, AuditResult):
        auditor = result.auditor
    elif isinstance(result, CanaryScoreAuditor):
        auditor, result = result, None
    else:
        raise InputTypeError(f"plot_audit expects an AuditResult or a CanaryScoreAuditor; got {type(result).__name__}.")
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    else:
        fig = axes[0].figure
    roc, bars = axes
    fpr = np.logspace(-4, 0, 200)
    roc.plot(fpr, auditor.tpr_at_given_fpr(fpr), label=f"attack (AUROC {auditor.attack_auroc():.3f})")
    roc.plot(fpr, fpr, "k:", label="chance")
    roc.set(xscale="log", yscale="log", xlabel="false positive rate", ylabel="true positive rate", title="ROC")
    roc.legend(loc="lower right")
    if result is not None:
        names = ["any mechanism", "f-DP", "GDP", "accountant"]
        values = [result.epsilon_any_mechanism, result.epsilon_fdp, result.epsilon_gdp, result.epsilon_accountant]
        colors = ["C0", "C0", "C0", "C3"]
        bars.bar(names, values, color=colors)
        bars.axhline(result.epsilon_accountant, color="C3", ls="--", lw=1)
        bars.set(ylabel=f"epsilon at delta={result.delta:g}",
                 title=f"lower bounds ({1 - result.significance:.0%}) vs claim")
    else:
        bars.set_axis_off()
    fig.tight_layout()
    return fig
