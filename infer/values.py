"""Host-side checks and bucket arithmetic shared by the inference entry points (DESIGN §7)."""

from __future__ import annotations

import numpy as np


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x) -> bool:
    """A Python or numpy real number, not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def pow2(n: int) -> int:
    """The smallest power of two ≥ n (n ≥ 1)."""
    return 1 << (n - 1).bit_length()


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m
