"""Parameter initializers shared by every block: parameters are plain float32 pytrees."""

import jax
import jax.numpy as jnp


def dense(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """A weight `[..., fan_in, fan_out]` drawn from N(0, std²), float32."""
    return std * jax.random.normal(key, shape, jnp.float32)


def ones(n: int) -> jax.Array:
    """An RMSNorm weight."""
    return jnp.ones((n,), jnp.float32)


def linear(x: jax.Array, w: jax.Array, dtype: str) -> jax.Array:
    """`x @ w` with operands in the compute `dtype` (DESIGN §6), accumulated and returned in float32."""
    return jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
