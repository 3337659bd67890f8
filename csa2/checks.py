"""Host-side checks shared by every package above the kernels (DESIGN §7), and the one byte count.

A bad value at a public boundary raises `ValueError` naming the field, the value and the fix (`fail`).
Two integer tests, because two kinds of integer cross the boundaries: a *static* value (a config field,
a replay window, a layer count: hashable and written to JSON) must be a Python `int`; a *host* value
(a batch size, a seed, a step, a token count) may also be a numpy integer. Neither accepts a bool.
This module imports nothing from csa2, so every module, `csa2.config` included, may use it.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import jax
import numpy as np


def fail(field: str, value: Any, fix: str) -> NoReturn:
    """Raise the DESIGN §7 error: `ValueError("{field}={value!r}: {fix}")`."""
    raise ValueError(f"{field}={value!r}: {fix}")


def is_static_int(x: Any) -> bool:
    """A Python int, not a bool: what a config field or a static argument holds."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_int(x: Any) -> bool:
    """A Python or numpy integer, not a bool: a count, a seed or a step given on the host."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x: Any) -> bool:
    """A Python or numpy real number, not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def tree_bytes(tree: Any) -> int:
    """Bytes of the array leaves of `tree` (size × itemsize), concrete or abstract (`jax.ShapeDtypeStruct`)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
