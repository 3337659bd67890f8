"""Meshes and logical-axis rules: where each array lives on a device mesh (below the model: nothing here imports it).

Every parameter carries logical axis names (`out_sharding` metadata, `csa2.params`; e.g. wq_b is
`("groups", "layers", "q_lora", "heads")`), and so does every argument of a compiled entry point (`batch` for the
rows of a request state, tokens and per-row values). A **rules table** maps each logical name to a mesh axis
(or None: that dimension is replicated); an array's `PartitionSpec` is its axes looked up in the table. Rules
are data, one table per preset (`RULES`), and a caller may pass its own; a rule may also name a tuple of mesh
axes (the dimension splits over their product).

Mesh axes (`MESH_AXES`): `data` (batch), `tensor` (heads, vocab, expert width), `expert` (routed
experts). A mesh is built by `make_mesh({"data": 2, "tensor": 2, "expert": 2})`; axes left out have size 1.

| logical axis                      | v41_flash | tiny / mini / demo | why                                             |
|-----------------------------------|-----------|--------------------|-------------------------------------------------|
| `batch`                           | data      | data               | the rows of requests, tokens and per-row values |
| `vocab`                           | tensor    | —                  | embedding and LM head rows (259 does not split) |
| `heads`, `index_heads`, `index_n` | tensor    | tensor             | attention heads                                 |
| `o_groups`, `o_lora_all`          | tensor    | tensor             | attention heads' output groups                  |
| `experts`                         | expert    | expert             | routed experts                                  |
| `mlp`                             | tensor    | tensor             | expert and shared-expert width                  |
| `engram_dim`                      | expert    | —                  | Engram table columns (rows: see below)          |
| `engram_rows`                     | —         | —                  | a sum of primes (384,016,682 = 2 · 192,008,341) |
| everything else                   | —         | —                  | norms, mHC, latents, stacking axes: replicated  |

The released model's two Engram tables are its largest arrays (2 × 393 GB in float32, 2 × 98 GB as FP8
rows). Their row counts are sums of primes that no mesh divides, so their 256 columns split instead, over
`expert` (the widest axis of the meshes that hold the released model): a lookup gathers every row's
local columns and the projection after it sums the partial products (one all-reduce per Engram layer).

`spec` checks every array before anything is placed: an unknown logical axis, a mesh axis the mesh lacks, a
dimension the mesh axis does not divide, or one mesh axis on two dimensions of an array raise `ValueError`
naming the array, the axis and the fix. The MoE's expert-parallel `shard_map` (`csa2.moe`) reads routed experts
on `expert` and their width on `tensor`, so a table may map `experts` only to `expert` (or None) and `mlp` only
to `tensor` (or None).

**FSDP.** A rules table may also name, under the key `FSDP` (`"fsdp"`), a mesh axis over which every parameter
splits as well (`with_fsdp(rules)`: over `data`, as MaxText and Megatron train this family): each parameter's
largest dimension that its own rules leave whole, that the axis divides and that FSDP may split: not a stacking
axis (`groups`, `layers`: the scanned stack iterates them) and not an Engram table's rows (a layer reads a few
rows of its table, so gathering the whole table per layer would cost more than splitting it saves). A parameter
with no such dimension stays whole over that axis. Optimizer moments follow their parameters, so AdamW's state
splits the same way. Inside the scanned stack each layer's parameters are gathered whole over the FSDP axis
where the layer starts (`gather_fsdp`), so a layer's matmuls see whole weights and its gradients go back to
their shards (a reduce-scatter, or an all-reduce and a slice where a backend lowers it so). With a remat policy
(`csa2.remat`) only one layer's gathered weights are live at a time; without one the backward pass keeps every
layer's.

How an entry point's arguments are placed is named by a **placement** per argument (`ROWS`, `REPLICATED`,
`PARAMS`, or a function of the same form): a function `(value, mesh, rules, what) → shardings` of the value's
pytree. `csa2.boundary.EntryPoint.on(mesh, rules)` compiles an entry point with them.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "tensor", "expert")
Rules = Mapping[str, str | tuple[str, ...] | None]
FSDP = "fsdp"  # the rules entry naming the mesh axis every parameter also splits over (absent or None: no FSDP)
_NOT_FSDP = ("groups", "layers", "engram_rows")  # never split by FSDP (module docstring)

_REPLICATED = ("embed", "q_lora", "latent", "o_group_in", "o_lora", "index_dim", "hc_in", "hc_mix", "hc_scales",
               "engram_dim", "engram_scales", "engram_in", "engram_out", "streams", "draft_features", "markov",
               "draft_confidence", "groups", "layers")
_SMALL = {**{name: None for name in _REPLICATED}, "batch": "data", "vocab": None, "heads": "tensor",
          "index_heads": "tensor", "index_n": "tensor", "o_groups": "tensor", "o_lora_all": "tensor",
          "experts": "expert", "mlp": "tensor", "engram_rows": None}
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


def with_fsdp(rules: Rules, axis: str = "data") -> dict[str, str | tuple[str, ...] | None]:
    """`rules` with every parameter (and so its optimizer moments) also split over mesh axis `axis` (module
    docstring, FSDP)."""
    out = {**rules, FSDP: axis}
    check_rules(out)
    return out


def check_rules(rules: Rules) -> None:
    """The MoE's shard_map reads experts on `expert` and their width on `tensor`: a table must agree. An FSDP
    entry names one mesh axis."""
    fsdp = rules.get(FSDP)
    if fsdp is not None and fsdp not in MESH_AXES:
        raise ValueError(f"rules: {FSDP!r} → {fsdp!r}; name one mesh axis of {MESH_AXES} (e.g. 'data'), or None "
                         "for no FSDP")
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


def parameter_spec(axes: Sequence[str], shape: Sequence[int], mesh: Mesh | jax.sharding.AbstractMesh, rules: Rules,
                   what: str) -> PartitionSpec:
    """`spec` of a parameter, plus its FSDP split when the rules name an FSDP axis (module docstring): the largest
    dimension its rules leave whole, that FSDP may split and the axis divides (the first of equals)."""
    out = spec(axes, shape, mesh, rules, what)
    axis = rules.get(FSDP)
    if axis is None:
        return out
    if axis not in mesh.shape:
        raise ValueError(f"{what}: rule {FSDP!r} → {axis!r}, but the mesh has axes {tuple(mesh.shape)}; use a mesh "
                         f"with a {axis!r} axis, or rules without FSDP")
    if mesh.shape[axis] == 1:
        return out
    used = {t for target in out if target is not None for t in ((target,) if isinstance(target, str) else target)}
    free = [i for i, (name, size, target) in enumerate(zip(axes, shape, out))
            if target is None and name not in _NOT_FSDP and size % mesh.shape[axis] == 0]
    if axis in used or not free:
        return out
    widest = max(free, key=lambda i: shape[i])
    return PartitionSpec(*(axis if i == widest else target for i, target in enumerate(out)))


def gather_fsdp(params, axes: Callable[[], Any]):
    """Inside a trace under a mesh whose rules in use name an FSDP axis: `params` (a layer's, unstacked) constrained
    to their shardings without it, i.e. gathered whole over the FSDP axis (module docstring); `axes()` gives the
    same tree of each leaf's logical axes (called only then). Otherwise `params` unchanged."""
    rules = rules_in_use()
    mesh = jax.sharding.get_abstract_mesh()
    if rules.get(FSDP) is None or mesh.empty or mesh.shape.get(rules[FSDP], 1) == 1:
        return params
    whole = {k: v for k, v in rules.items() if k != FSDP}

    def gathered(path, a, names):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec(
            names, a.shape, mesh, whole, f"gather_fsdp: parameter {jax.tree_util.keystr(path)}")))

    return jax.tree_util.tree_map_with_path(gathered, params, axes())


# The rules a compiled entry point is being traced with (`EntryPoint.on` sets them next to `jax.set_mesh`), so
# code that names mesh axes inside the model (the MoE's shard_map) reads them from the rules, not from literals.
# Outside `on` (a plain `jax.set_mesh`), the default names: experts on `expert`, their width on `tensor`, rows on
# `data`.
_RULES_IN_USE: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("csa2_rules", default=None)
_DEFAULT_AXES = {"batch": "data", **_MOE_AXES}


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[None]:
    """Trace with `rules` in use (`rules_in_use`)."""
    token = _RULES_IN_USE.set(rules)
    try:
        yield
    finally:
        _RULES_IN_USE.reset(token)


def rules_in_use() -> Rules:
    """The rules being traced with (`use_rules`), else the default mesh axis of the rows and the experts."""
    rules = _RULES_IN_USE.get()
    return _DEFAULT_AXES if rules is None else rules


# ---------------------------------------------------------------------------------------------
# Placements: how an entry point's argument (a pytree) is laid out on a mesh

Placement = Callable[[Any, Mesh, Rules, str], Any]


def rows(mesh: Mesh, rules: Rules | None = None) -> NamedSharding:
    """Split over the `batch` rule's mesh axis (`data` when no rules are given) along the leading axis, the rest
    replicated: a prefix for any per-row pytree."""
    return NamedSharding(mesh, PartitionSpec("data" if rules is None else rules.get("batch", "data")))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_batch(batch: int, mesh: Mesh, what: str) -> None:
    """A batch of `batch` rows splits over `data`, or ValueError naming `what`."""
    if batch % mesh.shape["data"]:
        raise ValueError(f"{what}: batch {batch} does not split over mesh axis 'data' of size {mesh.shape['data']}; "
                         "use a batch that is a multiple of it")


def ROWS(value, mesh: Mesh, rules: Rules, what: str):
    """Every leaf leads with the batch: split over `batch` (checked to divide)."""
    leaves = jax.tree.leaves(value)
    if leaves and np.ndim(leaves[0]):
        check_batch(np.shape(leaves[0])[0], mesh, what)
    return jax.tree.map(lambda _: rows(mesh, rules), value)


def REPLICATED(value, mesh: Mesh, rules: Rules, what: str):
    """Every leaf whole on every device (keys, scalars, small tables)."""
    return jax.tree.map(lambda _: replicated(mesh), value)


def PARAMS(value: nnx.State, mesh: Mesh, rules: Rules, what: str) -> nnx.State:
    """An `nnx.State` of parameters (arrays or shapes), each by its own logical axes (`out_sharding` metadata) and
    the rules: an `nnx.State` of `NamedSharding`s in the same structure."""
    check_rules(rules)
    names = nnx.to_pure_dict(nnx.get_partition_spec(value))

    def one(path, logical, array):
        return NamedSharding(mesh, parameter_spec(tuple(logical), array.shape, mesh, rules,
                                                  f"{what}: parameter {jax.tree_util.keystr(path)}"))

    shardings = jax.tree_util.tree_map_with_path(one, names, nnx.to_pure_dict(value),
                                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
    out = jax.tree.map(lambda a: a, value)  # the same structure, then each leaf replaced by its sharding
    nnx.replace_by_pure_dict(out, shardings)
    return out


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
