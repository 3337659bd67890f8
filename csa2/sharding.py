"""A model's parameters and request states placed on a device mesh (above the model: it reads the model's
parameter declarations). The mesh, the rules tables and the placements are `csa2.mesh`; an entry point compiled
for a mesh is `EntryPoint.on(mesh, rules)` (`csa2.boundary`): e.g. `model.decode_step.on(mesh, rules)(params,
state, tokens)` with explicit in and out shardings (parameters by the rules, every request-state leaf and
per-row array over `data`, the rest replicated), the state donated, traced under `jax.set_mesh(mesh)` so the MoE
runs expert-parallel.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from csa2 import state as state_lib
from csa2.config import ModelConfig
from csa2.mesh import PARAMS, ROWS, Rules
from csa2.model import abstract_params


def param_state_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> nnx.State:
    """`NamedSharding` of every parameter of `cfg` as an `nnx.State` (the structure the entry points take),
    checked before anything is placed (`csa2.mesh.spec`)."""
    return PARAMS(abstract_params(cfg), mesh, rules, "params")


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> dict:
    """`param_state_shardings` as a pure dict in the structure of `init_params`."""
    return nnx.to_pure_dict(param_state_shardings(cfg, mesh, rules))


def shard_params(cfg: ModelConfig, params: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """`params` placed on `mesh` by `rules` (a new State; the caller's arrays are not consumed)."""
    shardings = param_shardings(cfg, mesh, rules)
    out = abstract_params(cfg)
    nnx.replace_by_pure_dict(out, jax.tree.map(jax.device_put, nnx.to_pure_dict(params), shardings))
    return out


def state_shardings(state, mesh: Mesh):
    """Every leaf of a request `State` (all lead with the batch) split over `data` along its rows."""
    return ROWS(state, mesh, {"batch": "data"}, "state")


def init_state(cfg: ModelConfig, batch: int, capacity: int, mesh: Mesh, cache_format: str = "fp4"):
    """`csa2.state.init_state` created directly in its shards (rows over `data`)."""
    abstract = state_lib.abstract_state(cfg, batch, capacity, cache_format)
    return jax.jit(lambda: state_lib.init_state(cfg, batch, capacity, cache_format),
                   out_shardings=state_shardings(abstract, mesh))()
