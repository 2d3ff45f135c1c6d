"""Statistics for held-out claims: a mean with its 95% interval, and the paired difference of two models on the
same prompts with its interval (Student's t; a gain counts only when its interval lies above 0)."""
from __future__ import annotations

import math
from collections.abc import Sequence

from scipy.stats import t as student_t


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
    half = float(student_t.ppf(0.975, len(finite) - 1)) * std / math.sqrt(len(finite))
    return mean, mean - half, mean + half


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of after[i] - before[i] over the prompts both define: the paired t interval, which
    removes the prompt-to-prompt variance two unpaired means would carry."""
    if len(before) != len(after):
        raise ValueError(f"paired_difference needs the same prompts on both sides: {len(before)} vs {len(after)} "
                         f"values")
    return mean_interval([b - a for a, b in zip(before, after)])
