"""Statistical checks for sampled tokens."""

from __future__ import annotations

import math

import numpy as np


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x): the regularised upper incomplete gamma Q(df/2, x/2) (Numerical Recipes gammq)."""
    a, z = df / 2.0, x / 2.0
    if z < a + 1:  # series for P, then 1 - P
        term = total = 1.0 / a
        n = a
        for _ in range(10000):
            n += 1
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    b, c, d = z + 1 - a, 1e300, 1 / (z + 1 - a)  # continued fraction for Q
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def chi2_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    n = counts.sum()
    exp = expected_probs.ravel() * n
    obs = counts.ravel().astype(np.float64)
    big = exp >= 5  # merge the cells expected under 5 into one
    e = np.append(exp[big], exp[~big].sum())
    o = np.append(obs[big], obs[~big].sum())
    if e[-1] == 0:
        e, o = e[:-1], o[:-1]
    stat = float(((o - e) ** 2 / e).sum())
    return chi2_sf(stat, len(e) - 1)
