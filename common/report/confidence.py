"""Confidence intervals for the shares genq reports from samples."""

from __future__ import annotations

import math

Z95 = 1.959964  # two-sided 95 %


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials: honest at small n and near 0 or 1,
    where the normal approximation gives impossible bounds."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)
