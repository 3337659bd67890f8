"""RMSNorm, computed in float32 (DESIGN §6): `x · rsqrt(mean(x²) + eps) · weight`."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Normalize the last axis; `weight=None` gives the unweighted norm. Returns float32."""
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight.astype(jnp.float32)
