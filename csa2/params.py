"""Parameter declarations shared by every module, their initializers, and the compute-dtype matmul (DESIGN §2, §6).

Modules (`flax.nnx`) only declare parameters: each one is float32 (or a packed/integer table that is data), tagged
with its logical axis names (`out_sharding` metadata, e.g. `("embed", "q_lora")`), which a mesh's rules map to
devices, and with its initializer (`init` metadata: `Normal(std)`, `Fill(value)`, or a table's own). Nothing is
sharded eagerly here. The math lives in pure functions that read a plain dict of arrays (`arrays`), never a module.

Two ways to get values. A module constructed with `nnx.Rngs` draws its own with JAX (tests build single modules
so). A whole model is drawn by `initialize`: its parameters' shapes come from `nnx.eval_shape` (a trace, nothing
compiled) and each leaf is drawn on the host by its declared initializer from a NumPy generator seeded with the
key and the leaf's path (under a transform, through `jax.pure_callback`). Tracing and compiling one JAX draw per
parameter shape costs about a minute for the `tiny` preset on two CPU cores; the host draws take a fraction of a
second. Per-path seeds make a leaf's value independent of every other leaf (adding a parameter moves no other),
and a stacked leaf `[groups, layers, ...]` is one draw.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array
Axes = tuple[str, ...]


class Initializer(Protocol):
    """Draws a parameter's host value of `shape` from `rng`. Hashable (it is `nnx.Variable` metadata, so part of
    the state's tree structure). `stream` names the seed's last path element (None: the leaf's own name), so
    leaves drawn from one underlying draw (a packed table's payload and scales) name the same one."""

    stream: str | None

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Normal:
    """N(0, std²), float32."""

    std: float
    stream: str | None = None

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return np.float32(self.std) * rng.standard_normal(shape, dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Fill:
    """Every entry `value`, float32 (RMSNorm weights and mHC scales: 1; sinks, mHC biases, router biases: 0)."""

    value: float
    stream: str | None = None

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return np.full(shape, self.value, np.float32)


def initialize(declared: nnx.State, key: Array) -> nnx.State:
    """`declared` (a state of shapes, from `nnx.eval_shape`) with every leaf drawn on the host by its `init`
    metadata, from `np.random.default_rng([*key_data, crc32(path)])`, path the leaf's `/`-joined path with its last
    element replaced by the initializer's `stream` when it names one. A concrete key draws at once; a traced one
    (under `jit`, `vmap`, `eval_shape`) draws through `jax.pure_callback` when the program runs, the same values."""
    flat = nnx.to_flat_state(declared)
    words = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    if words.dtype != jnp.uint32:
        raise ValueError(f"key: dtype {words.dtype}; pass jax.random.key(seed) or jax.random.PRNGKey(seed)")

    def draw(words: np.ndarray) -> list[np.ndarray]:
        seed = [int(w) for w in np.asarray(words).ravel()]
        out = []
        for path, variable in flat:
            init = variable.get_metadata()["init"]
            names = [str(p) for p in path[:-1]] + [init.stream or str(path[-1])]
            out.append(init(np.random.default_rng([*seed, zlib.crc32("/".join(names).encode())]), variable.shape))
        return out

    if isinstance(words, jax.core.Tracer):
        shapes = [jax.ShapeDtypeStruct(v.shape, v.get_value().dtype) for _, v in flat]
        values = jax.pure_callback(draw, shapes, words, vmap_method="sequential")
    else:
        values = [jnp.asarray(x) for x in draw(words)]
    return nnx.from_flat_state([(path, v.replace(x)) for (path, v), x in zip(flat, values)])


def _declare(kind: type[nnx.Variable], value: Array, axes: Axes, init: Initializer, **metadata) -> nnx.Variable:
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match the parameter shape {value.shape}; name every axis")
    return kind(value, out_sharding=axes, eager_sharding=False, init=init, **metadata)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, axes: Axes, *, compute: bool = False) -> nnx.Param:
    """A weight `[..., fan_in, fan_out]` drawn from N(0, std²), float32. `compute`: the model reads it only in the
    compute dtype (`linear` and its kin), which `compute_weights` relies on."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return _declare(nnx.Param, value, axes, Normal(std), **({"compute": True} if compute else {}))


def ones(shape: tuple[int, ...], axes: Axes) -> nnx.Param:
    """A weight of ones (RMSNorm weights, mHC scales)."""
    return _declare(nnx.Param, jnp.ones(shape, jnp.float32), axes, Fill(1.0))


def zeros(shape: tuple[int, ...], axes: Axes, kind: type[nnx.Variable] = nnx.Param) -> nnx.Variable:
    """A weight of zeros (sinks, mHC biases), or a zero variable of another type."""
    return _declare(kind, jnp.zeros(shape, jnp.float32), axes, Fill(0.0))


def constant(value: Array, axes: Axes, kind: type[nnx.Variable], init: Initializer) -> nnx.Variable:
    """A variable of type `kind` holding `value` as given (tables that are data, not trained weights); `init` draws
    the same value on the host (`initialize`)."""
    return _declare(kind, jnp.asarray(value), axes, init)


def arrays(params: nnx.State) -> dict[str, Any]:
    """The plain nested dict of arrays the pure functions read (a relabelling, free under jit)."""
    return nnx.to_pure_dict(params)


def compute_weights(params: nnx.State, dtype: str) -> nnx.State:
    """`params` with every weight declared `compute=True` cast to `dtype` (DESIGN §6): the weights the model reads
    only through a cast to its compute dtype, so with `dtype` the model's compute dtype the forward values are
    unchanged and only where the cast happens moves (before a layer's weights are gathered or kept for the backward
    pass, in half the bytes with bfloat16). Everything SPEC keeps in float32 (router, mHC, norms, sinks, compressor,
    embeddings, Engram tables) is declared without it and stays as it is."""
    def cast(v):
        return v.replace(v.get_value().astype(dtype)) if v.get_metadata().get("compute") else v
    return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def linear(x: Array, w: Array, dtype: str) -> Array:
    """`x @ w` with operands in the compute `dtype` (DESIGN §6), accumulated and returned in float32."""
    return jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
