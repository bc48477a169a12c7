"""Integer helpers shared by the kernels' and the MoE planner's bucketing."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()
