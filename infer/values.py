"""Bucket arithmetic shared by the inference entry points and the experiments."""

from __future__ import annotations


def pow2(n: int) -> int:
    """The smallest power of two ≥ n (n ≥ 1)."""
    return 1 << (n - 1).bit_length()


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m
