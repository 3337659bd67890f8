"""Parameter declarations shared by every module, and the compute-dtype matmul (DESIGN §2, §6).

Modules (`flax.nnx`) only declare parameters: each one is float32, drawn by its initializer and
tagged with its logical axis names (`out_sharding` metadata, e.g. `("embed", "q_lora")`), which a
mesh's rules map to devices. Nothing is sharded eagerly here. The math lives in pure functions
that read a plain dict of arrays (`arrays`), never a module.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
Axes = tuple[str, ...]


def _declare(kind: type[nnx.Variable], value: Array, axes: Axes) -> nnx.Variable:
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match the parameter shape {value.shape}; name every axis")
    return kind(value, out_sharding=axes, eager_sharding=False)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, axes: Axes) -> nnx.Param:
    """A weight `[..., fan_in, fan_out]` drawn from N(0, std²), float32."""
    return _declare(nnx.Param, std * jax.random.normal(rngs.params(), shape, jnp.float32), axes)


def ones(shape: tuple[int, ...], axes: Axes) -> nnx.Param:
    """A weight of ones (RMSNorm weights, mHC scales)."""
    return _declare(nnx.Param, jnp.ones(shape, jnp.float32), axes)


def zeros(shape: tuple[int, ...], axes: Axes, kind: type[nnx.Variable] = nnx.Param) -> nnx.Variable:
    """A weight of zeros (sinks, mHC biases), or a zero variable of another type."""
    return _declare(kind, jnp.zeros(shape, jnp.float32), axes)


def constant(value: Array, axes: Axes, kind: type[nnx.Variable]) -> nnx.Variable:
    """A variable of type `kind` holding `value` as given (tables that are data, not trained weights)."""
    return _declare(kind, jnp.asarray(value), axes)


def arrays(params: nnx.State) -> dict[str, Any]:
    """The plain nested dict of arrays the pure functions read (a relabelling, free under jit)."""
    return nnx.to_pure_dict(params)


def linear(x: Array, w: Array, dtype: str) -> Array:
    """`x @ w` with operands in the compute `dtype` (DESIGN §6), accumulated and returned in float32."""
    return jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
