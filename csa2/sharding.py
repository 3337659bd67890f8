"""Meshes and logical-axis rules: where each parameter lives on a device mesh.

Every parameter carries logical axis names (`out_sharding` metadata, `csa2.params`; e.g. wq_b is
`("groups", "layers", "q_lora", "heads")`). A **rules table** maps each logical name to a mesh axis
(or None: that dimension is replicated); a parameter's `PartitionSpec` is its axes looked up in the
table. Rules are data, one table per preset (`RULES`), and a caller may pass its own; a rule may also
name a tuple of mesh axes (the dimension splits over their product).

Mesh axes (`MESH_AXES`): `data` (batch), `tensor` (heads, vocab, expert width), `expert` (routed
experts). A mesh is built by `make_mesh({"data": 2, "tensor": 2, "expert": 2})`; axes left out have size 1.

| logical axis                | v41_flash | tiny / mini / demo | why                                            |
|-----------------------------|-----------|--------------------|------------------------------------------------|
| `vocab`                     | tensor    | —                  | embedding and LM head rows (259 does not split) |
| `heads`, `index_heads`, `index_n`, `o_groups`, `o_lora_all` | tensor | tensor | attention heads and their output groups |
| `experts`                   | expert    | expert             | routed experts                                 |
| `mlp`                       | tensor    | tensor             | expert and shared-expert width                 |
| `engram_dim`                | expert    | —                  | Engram table columns (rows: see below)         |
| `engram_rows`               | —         | —                  | a sum of primes (384,016,682 = 2 · 192,008,341) |
| everything else             | —         | —                  | norms, mHC, latents, stacking axes: replicated |

The released model's two Engram tables are its largest arrays (2 × 393 GB in float32, 2 × 98 GB as FP8
rows). Their row counts are sums of primes that no mesh divides, so their 256 columns split instead, over
`expert` (the widest axis of the meshes that hold the released model): a lookup gathers every row's
local columns and the projection after it sums the partial products (one all-reduce per Engram layer).

`param_shardings(cfg, mesh)` checks every parameter before anything is placed: an unknown logical
axis, a mesh axis the mesh lacks, a dimension the mesh axis does not divide, or one mesh axis on two
dimensions of a parameter raise `ValueError` naming the parameter, the axis and the fix. The MoE's
expert-parallel `shard_map` (`csa2.moe`) reads routed experts on `expert` and their width on `tensor`, so a
table may map `experts` only to `expert` (or None) and `mlp` only to `tensor` (or None).

`Sharded(cfg, mesh, rules)` holds the entry points compiled for a mesh: explicit `in_shardings` and
`out_shardings` (parameters by the rules, every request-state leaf and per-row array over `data`, scalars
and per-layer aux replicated), the state donated, traced under `jax.set_mesh(mesh)` so the MoE runs
expert-parallel. `train.step.Sharded` does the same for the train step.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from csa2 import model
from csa2 import state as state_lib
from csa2.config import ModelConfig
from csa2.model import abstract_params
from csa2.replay import EXACT, Extend, ReplayPolicy

MESH_AXES = ("data", "tensor", "expert")
Rules = Mapping[str, str | tuple[str, ...] | None]

_REPLICATED = ("embed", "q_lora", "latent", "o_group_in", "o_lora", "index_dim", "hc_in", "hc_mix", "hc_scales",
               "engram_dim", "engram_scales", "engram_in", "engram_out", "streams", "draft_features", "markov",
               "draft_confidence", "groups", "layers")
_SMALL = {**{name: None for name in _REPLICATED}, "vocab": None, "heads": "tensor", "index_heads": "tensor",
          "index_n": "tensor", "o_groups": "tensor", "o_lora_all": "tensor", "experts": "expert", "mlp": "tensor",
          "engram_rows": None}
RULES: dict[str, dict[str, str | None]] = {
    "v41_flash": {**_SMALL, "vocab": "tensor", "engram_dim": "expert"},
    "tiny": _SMALL, "mini": _SMALL, "demo": _SMALL,
}


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes `MESH_AXES` (sizes from `shape`, missing ones 1) over `devices` (default: all)."""
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh axes {unknown} are unknown; name them from {MESH_AXES}")
    sizes = tuple(int(shape.get(axis, 1)) for axis in MESH_AXES)
    if any(s < 1 for s in sizes):
        raise ValueError(f"mesh shape {dict(shape)}: every axis size must be ≥ 1")
    devices = list(jax.devices() if devices is None else devices)
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh shape {dict(zip(MESH_AXES, sizes))} holds {int(np.prod(sizes))} devices but "
                         f"{len(devices)} are given; make the sizes multiply to {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)


def simulated_cpu_env(devices: int) -> dict[str, str]:
    """This process's environment for a fresh one that runs JAX on `devices` simulated CPU devices (the device
    count is fixed when JAX starts); the other XLA flags set here are kept."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


_MOE_AXES = {"experts": "expert", "mlp": "tensor"}  # where the expert-parallel shard_map reads them


def rules_for(cfg_name: str) -> dict[str, str | None]:
    """The rules table of a preset."""
    if cfg_name not in RULES:
        raise ValueError(f"rules_for: no rules table for {cfg_name!r}; use one of {sorted(RULES)} or pass rules=")
    return RULES[cfg_name]


def _check_rules(rules: Rules) -> None:
    for axis, target in _MOE_AXES.items():
        if rules.get(axis) not in (target, None):
            raise ValueError(f"rules: {axis!r} → {rules[axis]!r}, but the MoE's expert-parallel shard_map reads "
                             f"{axis!r} on mesh axis {target!r}; map it to {target!r} or None")


def spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules, what: str) -> PartitionSpec:
    """The `PartitionSpec` of one array with logical `axes` and `shape` (checked against `mesh`). A rule's target
    is a mesh axis, a tuple of mesh axes (the dimension splits over their product) or None."""
    out, used = [], set()
    for axis, size in zip(axes, shape):
        if axis is not None and axis not in rules:
            raise ValueError(f"{what}: logical axis {axis!r} has no rule; add it to the rules table "
                             f"(known: {sorted(rules)})")
        target = None if axis is None else rules[axis]
        targets = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        for t in targets:
            if t not in mesh.shape:
                raise ValueError(f"{what}: rule {axis!r} → {target!r}, but the mesh has axes {tuple(mesh.shape)}")
            if t in used:
                raise ValueError(f"{what}: mesh axis {t!r} would shard two dimensions; map {axis!r} to None")
            used.add(t)
        ways = int(np.prod([mesh.shape[t] for t in targets]))
        if size % ways:
            raise ValueError(f"{what}: dimension {axis!r} of size {size} does not split over mesh axis "
                             f"{target!r} of size {ways}; pick a mesh size that divides {size} "
                             f"or map {axis!r} to None in the rules")
        out.append(target)
    return PartitionSpec(*out)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> dict:
    """`NamedSharding` of every parameter of `cfg` (a pure dict in the structure of `init_params`)."""
    _check_rules(rules)
    abstract = abstract_params(cfg)
    names = nnx.to_pure_dict(nnx.get_partition_spec(abstract))
    shapes = nnx.to_pure_dict(abstract)

    def one(path, logical, shape):
        return NamedSharding(mesh, spec(tuple(logical), shape.shape, mesh, rules, f"parameter {jax.tree_util.keystr(path)}"))

    return jax.tree_util.tree_map_with_path(one, names, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_state_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> nnx.State:
    """`param_shardings` as an `nnx.State` (the structure the entry points take), for `in_shardings`."""
    out = abstract_params(cfg)
    nnx.replace_by_pure_dict(out, param_shardings(cfg, mesh, rules))
    return out


def shard_params(cfg: ModelConfig, params: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """`params` placed on `mesh` by `rules` (a new State; the caller's arrays are not consumed)."""
    shardings = param_shardings(cfg, mesh, rules)
    out = abstract_params(cfg)
    nnx.replace_by_pure_dict(out, jax.tree.map(jax.device_put, nnx.to_pure_dict(params), shardings))
    return out


def rows(mesh: Mesh) -> NamedSharding:
    """Split over `data` along the leading (batch) axis, the rest replicated: a prefix for any per-row pytree."""
    return NamedSharding(mesh, PartitionSpec("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def state_shardings(state, mesh: Mesh):
    """Every leaf of a request `State` (all lead with the batch) split over `data` along its rows."""
    check_batch(jax.tree.leaves(state)[0].shape[0], mesh, "state")
    return jax.tree.map(lambda _: rows(mesh), state)


def check_batch(batch: int, mesh: Mesh, what: str) -> None:
    """A batch of `batch` rows splits over `data`, or ValueError naming `what`."""
    if batch % mesh.shape["data"]:
        raise ValueError(f"{what}: batch {batch} does not split over mesh axis 'data' of size {mesh.shape['data']}; "
                         "use a batch that is a multiple of it")


def init_state(cfg: ModelConfig, batch: int, capacity: int, mesh: Mesh, cache_format: str = "fp4"):
    """`csa2.state.init_state` created directly in its shards (rows over `data`)."""
    abstract = state_lib.abstract_state(cfg, batch, capacity, cache_format)
    return jax.jit(lambda: state_lib.init_state(cfg, batch, capacity, cache_format),
                   out_shardings=state_shardings(abstract, mesh))()


class Sharded:
    """The entry points of `cfg` compiled for `mesh` with explicit shardings: parameters in the rules' shardings
    (`param_state_shardings`), the state, tokens and every per-row input and output split over `data`, scalars
    and per-layer aux (loads, index KL) replicated; the state is donated as in `csa2.model`. Each call runs the
    entry point's host check and traces under `jax.set_mesh(mesh)`, so the MoE runs expert-parallel
    (`csa2.moe`). Arguments must already be placed (`shard_params`, `init_state`); an argument in another
    sharding is an error of `jax.jit`, never a silent copy to one device."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, rules: Rules):
        self.cfg, self.mesh = cfg, mesh
        self.params = param_state_shardings(cfg, mesh, rules)
        self._jitted: dict[tuple, Callable] = {}

    def _jit(self, key: tuple, fn: Callable, in_shardings: tuple, out_shardings, donate: tuple[int, ...] = ()):
        if key not in self._jitted:
            self._jitted[key] = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                                        donate_argnums=donate)
        return self._jitted[key]

    def _call(self, jitted: Callable, args: tuple, lower: bool):
        """Run `jitted` under the mesh, or with `lower=True` return it lowered for `args` (placed arrays or
        `jax.ShapeDtypeStruct`s): `.compile()` for ahead-of-time use and memory plans."""
        with jax.set_mesh(self.mesh):
            return jitted.lower(*args) if lower else jitted(*args)

    def forward(self, params: nnx.State, tokens, *, qat: bool = False, replay: ReplayPolicy = EXACT,
                lower: bool = False):
        """`csa2.model.forward` (logits and aux; the other options of `forward` run unsharded)."""
        model.forward.check(self.cfg, params, tokens, qat=qat, replay=replay)
        check_batch(tokens.shape[0], self.mesh, "tokens")
        cfg, row, rep = self.cfg, rows(self.mesh), replicated(self.mesh)
        jitted = self._jit(("forward", qat, replay),
                           lambda p, t: model.forward.__wrapped__(cfg, p, t, qat=qat, replay=replay),
                           (self.params, row), (row, {"load": rep, "index_kl": rep, "rows": row}))
        return self._call(jitted, (params, tokens), lower)

    def prefill(self, params: nnx.State, state: state_lib.State, tokens, n_valid=None,
                replay: ReplayPolicy = ReplayPolicy(), extend: Extend | None = None, lower: bool = False):
        """`csa2.model.prefill` (logits, the new state, `{"work"}`)."""
        model.prefill.check(self.cfg, params, state, tokens, n_valid, replay, extend)
        check_batch(tokens.shape[0], self.mesh, "tokens")
        if n_valid is None:
            n_valid = jax.device_put(jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32), rows(self.mesh))
        cfg, row = self.cfg, rows(self.mesh)
        jitted = self._jit(("prefill", replay, extend is None),
                           lambda p, s, t, n, e: model.prefill.__wrapped__(cfg, p, s, t, n, replay, e),
                           (self.params, row, row, row, row), (row, row, replicated(self.mesh)), donate=(1,))
        return self._call(jitted, (params, state, tokens, n_valid, extend), lower)

    def _state_step(self, entry, params: nnx.State, state: state_lib.State, tokens, lower: bool):
        """An entry point `(cfg, params, state, tokens) → (logits, state)`, the state donated."""
        entry.check(self.cfg, params, state, tokens)
        check_batch(tokens.shape[0], self.mesh, "tokens")
        row = rows(self.mesh)
        jitted = self._jit((entry.__name__,), functools.partial(entry.__wrapped__, self.cfg),
                           (self.params, row, row), (row, row), donate=(1,))
        return self._call(jitted, (params, state, tokens), lower)

    def decode_step(self, params: nnx.State, state: state_lib.State, tokens, lower: bool = False):
        """`csa2.model.decode_step` (logits and the new state)."""
        return self._state_step(model.decode_step, params, state, tokens, lower)

    def verify(self, params: nnx.State, state: state_lib.State, tokens, lower: bool = False):
        """`csa2.model.verify` (all logits and the speculative state; `csa2.model.commit` follows)."""
        return self._state_step(model.verify, params, state, tokens, lower)


class HostShards:
    """The host buffers of one array's addressable shards under `sharding`, written slot by slot (`x[index] = v`
    for a leading integer `index` and a value of the remaining dimensions) and assembled by `array()` with each
    buffer placed on its devices: nothing outside this process's shards is ever held."""

    def __init__(self, shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
        self.shape, self.dtype, self.sharding = tuple(shape), np.dtype(dtype), sharding
        self._devices = sharding.addressable_devices_indices_map(self.shape)
        self._buffers: dict[tuple, np.ndarray] = {}
        for index in self._devices.values():
            key = self._key(index)
            if key not in self._buffers:
                self._buffers[key] = np.empty([b - a for a, b in key], self.dtype)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def _key(self, index: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
        return tuple(sl.indices(n)[:2] for sl, n in zip(index, self.shape))

    def __setitem__(self, index: tuple[int, ...], value: np.ndarray) -> None:
        lead = len(index)
        for key, buf in self._buffers.items():
            if all(a <= i < b for i, (a, b) in zip(index, key[:lead])):
                local = tuple(i - a for i, (a, _) in zip(index, key[:lead]))
                buf[local] = value[tuple(slice(a, b) for a, b in key[lead:])]

    def array(self) -> jax.Array:
        pieces = [jax.device_put(self._buffers[self._key(index)], device) for device, index in self._devices.items()]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, pieces)
