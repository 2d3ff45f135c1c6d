"""Statistics for held-out claims: a mean with its 95% interval, and the paired difference of two models on the
same prompts with its interval (Student's t; a gain counts only when its interval lies above 0)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist


def t_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer df, in closed form (Abramowitz & Stegun 26.7.3-4): with
    theta = atan(t / sqrt(df)), a finite series in cos(theta)."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2))
        term = total = 1.0
        for k in range(2, df, 2):
            term *= (k - 1) / k * cos2
            total += term
        return sin * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = math.cos(theta)  # odd: 2/pi * (theta + sin * (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ...))
    for k in range(3, df - 1, 2):
        term *= (k - 1) / k * cos2
        total += term
    return 2 / math.pi * (theta + sin * total)


def t_quantile(probability: float, df: int) -> float:
    """Quantile of Student's t with `df` degrees of freedom (0.5 < probability < 1), by bisection on
    t_two_sided; beyond df = 2,000 the normal quantile's Cornish-Fisher correction (A&S 26.7.5), exact to 1e-9.

    >>> round(t_quantile(0.975, 3), 6), round(t_quantile(0.975, 63), 6), round(t_quantile(0.975, 10**6), 4)
    (3.182446, 1.998341, 1.96)
    """
    if df > 2000:
        z = NormalDist().inv_cdf(probability)
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    target, low, high = 2 * probability - 1, 0.0, 1.0
    while t_two_sided(high, df) < target:
        high *= 2
    for _ in range(100):  # the interval halves each time: far below float resolution after 100
        middle = (low + high) / 2
        low, high = (middle, high) if t_two_sided(middle, df) < target else (low, middle)
    return (low + high) / 2


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t interval mean +- t_{.975, n-1} * s / sqrt(n), s with Bessel's correction.
    NaN values (a metric a reward does not define) are left out; fewer than 2 values give NaN bounds.

    >>> [round(x, 4) for x in mean_interval([1.0, 0.0, 1.0, 1.0])]
    [0.75, -0.0456, 1.5456]
    """
    finite = [float(v) for v in values if not math.isnan(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, math.nan, math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))
    half = t_quantile(0.975, len(finite) - 1) * std / math.sqrt(len(finite))
    return mean, mean - half, mean + half


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of after[i] - before[i] over the prompts both define: the paired t interval, which
    removes the prompt-to-prompt variance two unpaired means would carry."""
    if len(before) != len(after):
        raise ValueError(f"paired_difference needs the same prompts on both sides: {len(before)} vs {len(after)} "
                         f"values")
    return mean_interval([b - a for a, b in zip(before, after)])
