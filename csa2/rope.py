"""Rotary position embedding (SPEC §7).

RoPE rotates the *trailing* ``rope_dim`` channels of the last axis as interleaved adjacent
pairs ``(x[2i], x[2i+1])`` of that slice; leading channels pass through. The rotation has
unit magnitude (no YaRN attention factor / mscale). Ratio-0 (SWA) layers use plain
frequencies with ``rope_theta``; ratio≠0 layers use ``compress_rope_theta`` with YaRN
frequencies. ``inverse=True`` applies the conjugate rotation (used on the attention output,
whose value carries RoPE because K = V, SPEC §3).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from csa2.config import YarnScaling


def rope_frequencies(rope_dim: int, base: float, yarn: YarnScaling | None = None) -> np.ndarray:
    """Per-pair angular frequencies, float32 ``[rope_dim // 2]``.

    Plain: ``base^(-2i/rope_dim)``. With ``yarn`` (SPEC §7, generalized from rope_dim=64):
    ``corr(r) = rope_dim·ln(orig/(2πr)) / (2 ln base)``, ``low = max(floor(corr(β_fast)), 0)``,
    ``high = min(ceil(corr(β_slow)), rope_dim - 1)`` (+0.001 if equal),
    ``ramp_i = clip((i - low)/(high - low), 0, 1)``, ``f_i ← f_i/factor·ramp_i + f_i·(1 - ramp_i)``.
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
    freqs = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if yarn is not None:

        def corr(rotations: float) -> float:
            orig = yarn.original_max_position_embeddings
            return rope_dim * math.log(orig / (2 * math.pi * rotations)) / (2 * math.log(base))

        low = max(math.floor(corr(yarn.beta_fast)), 0)
        high = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        freqs = freqs / yarn.factor * ramp + freqs * (1.0 - ramp)
    return freqs.astype(np.float32)


def apply_rope(x, positions, freqs, *, inverse: bool = False):
    """Rotate the trailing ``2 * len(freqs)`` channels of ``x`` by ``positions · freqs``.

    Args:
      x: ``[..., D]``, any float dtype; returned in the same dtype and shape.
      positions: integer array broadcastable (NumPy rules) to ``x.shape[:-1]``; e.g. for
        ``x [B, S, H, D]`` pass ``positions[:, :, None]`` (``[B, S, 1]``). Padded slots may hold
        any value (negative or garbage): the output stays finite.
      freqs: ``[n]`` frequencies from :func:`rope_frequencies`; requires ``2n <= D``.
      inverse: apply the conjugate rotation (angle ``-positions · freqs``).

    Angles and the rotation are computed in float32.
    """
    n = freqs.shape[-1]
    d = x.shape[-1]
    if 2 * n > d:
        raise ValueError(f"rope slice of {2 * n} channels exceeds last axis of size {d}")
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    pairs = x[..., d - 2 * n :].astype(jnp.float32).reshape(*x.shape[:-1], n, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(*x.shape[:-1], 2 * n)
    return jnp.concatenate([x[..., : d - 2 * n], rotated.astype(x.dtype)], axis=-1)
