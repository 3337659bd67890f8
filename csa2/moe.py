"""Mixture of experts of every layer (SPEC §9): sqrtsoftplus router, top-k routed SwiGLU experts, a shared expert.

- Router (float32): `s = sqrt(softplus(x·W_r / gate_temp))`; the experts are the top-k of `s + bias`
  (`bias_vl` for image tokens); the correction bias only selects: `w = s[idx] / (Σ s[idx] + 1e-20) · rsf`.
- Expert: `g = min(x·W1, L)`, `u = clip(x·W3, −L, L)`, `W2(silu(g)·u)` with L = `swiglu_limit`; the clamps
  and SwiGLU are float32. As in V4.1 the routing weight scales the hidden `silu(g)·u` before `W2`
  (V4 scales after `W2`; the same math, rounded differently in bfloat16).
- Dispatch: "dense" gathers each token's k experts (reference); "ragged" sorts the (token, slot) pairs by
  expert and multiplies the expert groups with the grouped matmul op `pallas_kernels.ops.ragged_dot` ("auto":
  in tiles when the groups are large, the work of the routed rows rather than of every expert; XLA's
  `lax.ragged_dot` when they are small). Both sum the k slots in the same order. One function,
  `_local_experts`, runs the routed experts on one device and inside the expert-parallel `shard_map`.
- Expert parallelism: traced under a mesh whose expert axis (the rules' `experts`, `csa2.mesh.rules_in_use`:
  `expert` by default) has more than one device, the routed experts run in a `shard_map`: each device holds
  `E / expert` experts (and `I / tensor` of their width, the rules' `mlp`) and the tokens of its row shard (the
  rules' `batch`), which every device of the expert and width axes already holds whole (activations are split
  over rows only). So dispatch needs no collective: a device multiplies the (token, slot) pairs routed to its
  own experts (`ops.ragged_dot` over its local groups, the implementation one device picks for the batch: in
  tiles when the groups are large, so its temporaries scale with the routed rows, not with rows × local experts)
  and the combine is one `psum` over expert × width of the per-token sums `[T, d]`. This is the all-gather
  formulation (tokens already gathered), chosen over a ragged all-to-all because the batch is not split over the
  expert axis: an all-to-all would only pay when it also split the tokens. The router, the load and the shared
  expert stay outside, partitioned by GSPMD, so the load (and the aux-loss-free bias update) counts every token
  of the global batch.
- Aux-loss-free balancing: `bias_update` moves the correction bias against the measured load, outside the
  optimizer; the bias is a `RouterBias` variable, so the optimizer excludes it by type.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from csa2.config import ModelConfig
from csa2.mesh import Rules, rules_in_use
from csa2.params import linear, normal, zeros
from csa2.remat import MOE_ROUTING
from pallas_kernels import ops
from pallas_kernels.grouped import tile_rows

Array = jax.Array

_DISPATCH = ("dense", "ragged")


class RouterBias(nnx.Variable):
    """The router's correction bias (SPEC §9): it only selects experts, and it moves by the aux-loss-free
    rule (`bias_update`), never by the optimizer, which leaves variables of this type alone."""


class SharedExpert(nnx.Module):
    """The always-on shared expert: SwiGLU `w2(silu(w1 x)·(w3 x))` of width `moe_intermediate_size`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, i, std = cfg.hidden_size, cfg.moe_intermediate_size, cfg.initializer_range
        self.w1 = normal(rngs, (d, i), std, ("embed", "mlp"), compute=True)
        self.w3 = normal(rngs, (d, i), std, ("embed", "mlp"), compute=True)
        self.w2 = normal(rngs, (i, d), std, ("mlp", "embed"), compute=True)


class MoE(nnx.Module):
    """Router `[d, E]`, zero correction biases `[E]` (text and image tokens), routed experts
    `[E, d, I]`/`[E, I, d]` and the shared expert (SPEC §9)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, e, i, std = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.initializer_range
        self.router = normal(rngs, (d, e), std, ("embed", "experts"))
        self.bias = zeros((e,), ("experts",), RouterBias)
        self.bias_vl = zeros((e,), ("experts",), RouterBias)
        self.w1 = normal(rngs, (e, d, i), std, ("experts", "embed", "mlp"), compute=True)
        self.w3 = normal(rngs, (e, d, i), std, ("experts", "embed", "mlp"), compute=True)
        self.w2 = normal(rngs, (e, i, d), std, ("experts", "mlp", "embed"), compute=True)
        if cfg.n_shared_experts:
            self.shared = SharedExpert(cfg, rngs)


def _check(cfg: ModelConfig, x: Array, image_mask: Array | None) -> None:
    """Raise ValueError on inputs that do not fit `cfg` (DESIGN §7)."""
    if x.ndim < 1 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(f"x.shape={tuple(x.shape)}: the last axis must be hidden_size={cfg.hidden_size}; "
                         "pass hidden states [..., hidden_size]")
    if image_mask is not None and tuple(image_mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"image_mask.shape={tuple(image_mask.shape)}: must equal x.shape[:-1]={tuple(x.shape[:-1])} "
                         "(one flag per token), or pass image_mask=None for text only")


def route(cfg: ModelConfig, params: dict, x: Array, image_mask: Array | None = None) -> tuple[Array, Array, Array]:
    """Routing weights `[T, k]` f32, experts `[T, k]` int32 and scores `s` `[T, E]` f32 of the flattened tokens."""
    _check(cfg, x, image_mask)
    x = x.reshape(-1, cfg.hidden_size).astype(jnp.float32)
    with jax.named_scope("fp32_router"):
        logits = jnp.matmul(x, params["router"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
    scores = jnp.sqrt(jax.nn.softplus(logits / cfg.gate_temp))  # [T, E]
    bias = params["bias"]
    if image_mask is not None:
        bias = jnp.where(image_mask.reshape(-1, 1).astype(bool), params["bias_vl"], bias)
    _, experts = jax.lax.top_k(scores + bias, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return weights, experts.astype(jnp.int32), scores


def _swiglu(g: Array, u: Array, limit: float) -> Array:
    """`silu(min(g, L)) · clip(u, ±L)` in float32 (SPEC §9: gate clamped from above only)."""
    return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)


def _dense_experts(cfg: ModelConfig, params: dict, x: Array, weights: Array, experts: Array) -> Array:
    """Reference dispatch: each token gathers its k experts' weights. `[T, d]` → `[T, k, d]` float32."""
    dt = cfg.dtype
    xd = x.astype(dt)
    g = jnp.einsum("td,tkdi->tki", xd, params["w1"][experts].astype(dt), preferred_element_type=jnp.float32)
    u = jnp.einsum("td,tkdi->tki", xd, params["w3"][experts].astype(dt), preferred_element_type=jnp.float32)
    h = _swiglu(g, u, cfg.swiglu_limit) * weights[..., None]
    return jnp.einsum("tki,tkid->tkd", h.astype(dt), params["w2"][experts].astype(dt),
                      preferred_element_type=jnp.float32)


def _local_experts(cfg: ModelConfig, x: Array, weights: Array, experts: Array, w1: Array, w3: Array, w2: Array,
                   first: Array | int, impl: str, tile: int | None = None) -> Array:
    """The routed experts `first … first + E_local − 1` (the `E_local` of `w1, w3, w2`) on the (token, slot) pairs
    routed to them: sort those pairs by expert, one grouped matmul per weight (`ops.ragged_dot` with `impl`),
    unsort, sum each token's k slots. Pairs routed to other experts (another device's) sort last, in no group,
    and add 0. `x [T, d]`, `weights`, `experts [T, k]` → `[T, d]` float32."""
    e_local, (k, dt) = w1.shape[0], (experts.shape[1], cfg.dtype)
    slot = (experts - first).reshape(-1)  # the pair's local expert
    mine = (slot >= 0) & (slot < e_local)
    slot = jnp.where(mine, slot, e_local)  # other experts' pairs: one group past the local ones
    order = jnp.argsort(slot, stable=True)  # pair p = token p // k, slot p % k
    sizes = jnp.bincount(slot, length=e_local + 1)[:e_local].astype(jnp.int32)

    def grouped(lhs: Array, w: Array) -> Array:
        return ops.ragged_dot(lhs.astype(dt), w.astype(dt), sizes, impl=impl, tile=tile)

    xs = x[order // k]  # [T·k, d], grouped by expert
    h = _swiglu(grouped(xs, w1), grouped(xs, w3), cfg.swiglu_limit) * weights.reshape(-1)[order][:, None]
    out = jnp.where(mine[order][:, None], grouped(h, w2), 0.0)  # [T·k, d]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return jnp.sum(out[inverse].reshape(-1, k, out.shape[-1]), axis=1)


def _expert_axes(rules: Rules, mesh: jax.sharding.AbstractMesh, x: Array, cfg: ModelConfig):
    """The mesh axes of the routed experts, their width and the tokens (from the rules: `experts`, `mlp`,
    `batch`), each None where it does not split; None for all when the experts do not split."""
    experts, width, batch = (rules.get(name) for name in ("experts", "mlp", "batch"))
    if experts is None or mesh.shape.get(experts, 1) == 1:
        return None
    if cfg.n_routed_experts % mesh.shape[experts]:
        raise ValueError(f"n_routed_experts={cfg.n_routed_experts} does not split over mesh axis {experts!r} of "
                         f"size {mesh.shape[experts]}; use an expert axis that divides {cfg.n_routed_experts}")

    def splits(axis, n):
        return axis if axis is not None and mesh.shape.get(axis, 1) > 1 and n % mesh.shape[axis] == 0 else None

    return experts, splits(width, cfg.moe_intermediate_size), splits(batch, x.shape[0])


def _expert_parallel(cfg: ModelConfig, params: dict, x: Array, weights: Array, experts: Array,
                     mesh: jax.sharding.AbstractMesh, axes: tuple) -> Array:
    """The routed experts' sum `[T, d]` float32 with the experts split over `mesh` (the module docstring says
    how): each device runs `_local_experts` on its own experts, one psum combines."""
    expert, width, rows = axes
    # The implementation and tiles one device would pick for the whole batch and every expert, so a mesh computes
    # as it does.
    pairs = x.shape[0] * weights.shape[1]
    impl, tile = ops.ragged_dot_impl(pairs, cfg.n_routed_experts), tile_rows(pairs, cfg.n_routed_experts)

    def local(x, weights, experts, w1, w3, w2):
        # Varying over the expert axis from the start: left to the implicit cast at the gathers, JAX 0.10.2
        # transposes the gather of `weights` into a scatter that puts each row's gradient in the wrong row.
        x, weights = jax.lax.pcast((x, weights), expert, to="varying")
        first = jax.lax.axis_index(expert) * w1.shape[0]
        y = _local_experts(cfg, x, weights, experts, w1, w3, w2, first, impl, tile)  # partial over `width`
        return jax.lax.psum(y, (expert,) if width is None else (expert, width))

    return jax.shard_map(local, mesh=mesh,
                         in_specs=(P(rows), P(rows), P(rows), P(expert, None, width), P(expert, None, width),
                                   P(expert, width, None)),
                         out_specs=P(rows))(x, weights, experts, params["w1"], params["w3"], params["w2"])


def moe(cfg: ModelConfig, params: dict, x: Array, *, image_mask: Array | None = None,
        dispatch: str = "ragged") -> tuple[Array, Array]:
    """The MoE output (same shape as `x`, float32) and the load `[E]`: each expert's share of the T·k assignments.
    "ragged" dispatch under a mesh with an `expert` axis runs the experts expert-parallel (module docstring)."""
    if dispatch not in _DISPATCH:
        raise ValueError(f"dispatch={dispatch!r}: use one of {_DISPATCH}")
    weights, experts, _ = route(cfg, params, x, image_mask)
    weights, experts = checkpoint_name((weights, experts), MOE_ROUTING)  # a save point of `csa2.remat`
    flat = x.reshape(-1, cfg.hidden_size)
    mesh = jax.sharding.get_abstract_mesh()
    axes = _expert_axes(rules_in_use(), mesh, flat, cfg) if dispatch == "ragged" else None
    if axes is not None:
        y = _expert_parallel(cfg, params, flat, weights, experts, mesh, axes)
    elif dispatch == "ragged":
        y = _local_experts(cfg, flat, weights, experts, params["w1"], params["w3"], params["w2"], 0, impl="auto")
    else:
        y = jnp.sum(_dense_experts(cfg, params, flat, weights, experts), axis=1)  # [T, d]
    if cfg.n_shared_experts:
        sp = params["shared"]
        h = _swiglu(linear(flat, sp["w1"], cfg.dtype), linear(flat, sp["w3"], cfg.dtype), cfg.swiglu_limit)
        y = y + linear(h, sp["w2"], cfg.dtype)
    load = jnp.bincount(experts.reshape(-1), length=cfg.n_routed_experts) / experts.size
    return y.reshape(x.shape), load.astype(jnp.float32)


def bias_update(bias: Array, load: Array, rate: float) -> Array:
    """Aux-loss-free balancing (SPEC §9): `bias + rate · sign(mean(load) − load)`, under-loaded experts rise."""
    if tuple(bias.shape) != tuple(load.shape):
        raise ValueError(f"load.shape={tuple(load.shape)}: must equal bias.shape={tuple(bias.shape)} "
                         "(one load per expert, as returned by moe)")
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
