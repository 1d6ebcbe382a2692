"""The perfect-attack ceiling per canary count: the most each estimator can certify.

Prints the markdown table of docs/auditing.md (perfectly separated scores, half of the
canaries in, significance 0.05, delta 1e-5; the one-run bound also at delta 0).

    python examples/audit_ceiling.py
"""

from __future__ import annotations

from opake_fx.auditing import OneRunEstimate, perfect_attack_ceiling

import numpy as np


def table(counts=(100, 200, 500, 1000, 2000, 5000, 10_000), significance: float = 0.05, delta: float = 1e-5) -> str:
    rows = ["| canaries | one-run, any mechanism (delta 0) | one-run, any mechanism | one-run f-DP (Gaussian) "
            "| Clopper-Pearson (two-sample) | GDP (two-sample) |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in counts:
        c = perfect_attack_ceiling(m, significance=significance, delta=delta)
        inside = np.arange(m) < m // 2
        pure = OneRunEstimate(scores=inside.astype(float), included=inside, canary_ids=np.arange(m)).epsilon_at(
            0.0, significance)
        rows.append(f"| {m} | {pure:.2f} | {c['one_run']:.2f} | {c['one_run_fdp']:.2f} | {c['clopper_pearson']:.2f} "
                    f"| {c['gdp']:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
