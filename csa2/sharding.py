"""Meshes and logical-axis rules: where each parameter lives on a device mesh.

Every parameter carries logical axis names (`out_sharding` metadata, `csa2.params`; e.g. wq_b is
`("groups", "layers", "q_lora", "heads")`). A **rules table** maps each logical name to a mesh axis
(or None: that dimension is replicated); a parameter's `PartitionSpec` is its axes looked up in the
table. Rules are data, one table per preset (`RULES`), and a caller may pass its own.

Mesh axes (`MESH_AXES`): `data` (batch), `tensor` (heads, vocab, expert width), `expert` (routed
experts). A mesh is built by `make_mesh({"data": 2, "tensor": 2, "expert": 2})`; axes left out have size 1.

| logical axis                | v41_flash | tiny / mini / demo | why                                            |
|-----------------------------|-----------|--------------------|------------------------------------------------|
| `vocab`                     | tensor    | —                  | embedding and LM head rows (259 does not split) |
| `heads`, `index_heads`, `index_n`, `o_groups`, `o_lora_all` | tensor | tensor | attention heads and their output groups |
| `experts`                   | expert    | expert             | routed experts                                 |
| `mlp`                       | tensor    | tensor             | expert and shared-expert width                 |
| `engram_rows`               | —         | —                  | a sum of primes (384,016,682 = 2 · 192,008,341) |
| everything else             | —         | —                  | norms, mHC, latents, stacking axes: replicated |

`param_shardings(cfg, mesh)` checks every parameter before anything is placed: an unknown logical
axis, a mesh axis the mesh lacks, a dimension the mesh axis does not divide, or one mesh axis on two
dimensions of a parameter raise `ValueError` naming the parameter, the axis and the fix.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from csa2 import state as state_lib
from csa2.config import ModelConfig
from csa2.model import abstract_params

MESH_AXES = ("data", "tensor", "expert")
Rules = Mapping[str, str | None]

_REPLICATED = ("embed", "q_lora", "latent", "o_group_in", "o_lora", "index_dim", "hc_in", "hc_mix", "hc_scales",
               "engram_dim", "engram_scales", "engram_in", "engram_out", "streams", "draft_features", "markov",
               "draft_confidence", "groups", "layers")
_SMALL = {**{name: None for name in _REPLICATED}, "vocab": None, "heads": "tensor", "index_heads": "tensor",
          "index_n": "tensor", "o_groups": "tensor", "o_lora_all": "tensor", "experts": "expert", "mlp": "tensor",
          "engram_rows": None}
RULES: dict[str, dict[str, str | None]] = {
    "v41_flash": {**_SMALL, "vocab": "tensor"},
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


def rules_for(cfg_name: str) -> dict[str, str | None]:
    """The rules table of a preset."""
    if cfg_name not in RULES:
        raise ValueError(f"rules_for: no rules table for {cfg_name!r}; use one of {sorted(RULES)} or pass rules=")
    return RULES[cfg_name]


def spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules, what: str) -> PartitionSpec:
    """The `PartitionSpec` of one array with logical `axes` and `shape` (checked against `mesh`)."""
    out, used = [], set()
    for axis, size in zip(axes, shape):
        if axis is not None and axis not in rules:
            raise ValueError(f"{what}: logical axis {axis!r} has no rule; add it to the rules table "
                             f"(known: {sorted(rules)})")
        target = None if axis is None else rules[axis]
        if target is not None:
            if target not in mesh.shape:
                raise ValueError(f"{what}: rule {axis!r} → {target!r}, but the mesh has axes {tuple(mesh.shape)}")
            if target in used:
                raise ValueError(f"{what}: mesh axis {target!r} would shard two dimensions; map {axis!r} to None")
            if size % mesh.shape[target]:
                raise ValueError(f"{what}: dimension {axis!r} of size {size} does not split over mesh axis "
                                 f"{target!r} of size {mesh.shape[target]}; pick a mesh size that divides {size} "
                                 f"or map {axis!r} to None in the rules")
            used.add(target)
        out.append(target)
    return PartitionSpec(*out)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> dict:
    """`NamedSharding` of every parameter of `cfg` (a pure dict in the structure of `init_params`)."""
    abstract = abstract_params(cfg)
    names = nnx.to_pure_dict(nnx.get_partition_spec(abstract))
    shapes = nnx.to_pure_dict(abstract)

    def one(path, logical, shape):
        return NamedSharding(mesh, spec(tuple(logical), shape.shape, mesh, rules, f"parameter {jax.tree_util.keystr(path)}"))

    return jax.tree_util.tree_map_with_path(one, names, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(cfg: ModelConfig, params: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """`params` placed on `mesh` by `rules` (a new State; the caller's arrays are not consumed)."""
    shardings = param_shardings(cfg, mesh, rules)
    out = abstract_params(cfg)
    nnx.replace_by_pure_dict(out, jax.tree.map(jax.device_put, nnx.to_pure_dict(params), shardings))
    return out


def state_shardings(state, mesh: Mesh):
    """Every leaf of a request `State` (all lead with the batch) split over `data` along its rows."""
    batch = jax.tree.leaves(state)[0].shape[0]
    if batch % mesh.shape["data"]:
        raise ValueError(f"state: batch {batch} does not split over mesh axis 'data' of size {mesh.shape['data']}; "
                         "use a batch that is a multiple of it")
    return jax.tree.map(lambda a: NamedSharding(mesh, PartitionSpec("data", *[None] * (a.ndim - 1))), state)


def init_state(cfg: ModelConfig, batch: int, capacity: int, mesh: Mesh, cache_format: str = "fp4"):
    """`csa2.state.init_state` created directly in its shards (rows over `data`)."""
    abstract = state_lib.abstract_state(cfg, batch, capacity, cache_format)
    return jax.jit(lambda: state_lib.init_state(cfg, batch, capacity, cache_format),
                   out_shardings=state_shardings(abstract, mesh))()


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
