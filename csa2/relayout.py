"""Parameters of layout 2 moved to layout 3 (`layout.LAYOUTS`).

Layout 2 kept an Engram layer's n-gram memory inside that layer's parameters, so every Engram layer stood in a
layer group of its own (`layout.layer_groups(cfg, layout=2)`: for the released schedule ten groups, one scanned
body each). Layout 3 keeps the memories apart (`params["engram"][k]`, the k-th of `cfg.engram_layer_ids`), so
the groups they split merge (four, and a program holds seven layer bodies instead of ten). `from_layout2` moves every
layer's parameters from its place in one layout to its place in the other, values unchanged: it reads older
checkpoints (`csa2.checkpoints.native`), and `model.init_params` draws in layout 2 and moves, so a key gives the
values it gave before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from csa2.config import ModelConfig
from csa2.layout import addresses, layer_groups


def _layer(tree: dict, address: tuple[int, int, int, int]) -> dict:
    gi, it, ri, j = address
    return jax.tree.map(lambda a: a[it, j], tree["groups"][gi][ri])


def _stack(trees: list):
    """Leaf by leaf, `trees` stacked on a new leading axis: with NumPy on host values (no program per shape), with
    JAX on traced ones."""
    return jax.tree.map(lambda *a: (jnp if isinstance(a[0], jax.core.Tracer) else np).stack(a), *trees)


def _host(a):
    return a if isinstance(a, jax.core.Tracer) else np.asarray(a)


def from_layout2(cfg: ModelConfig, params: nnx.State, like: nnx.State) -> nnx.State:
    """`params` (an `nnx.State` in layout 2) in layout 3, in the structure and variable types of `like` (the
    layout-3 `model.abstract_params(cfg)`, filled in place and returned)."""
    tree, old = jax.tree.map(_host, nnx.to_pure_dict(params)), addresses(cfg, 2)
    layers = {layer: _layer(tree, address) for layer, address in old.items()}  # views: slicing copies nothing
    groups = {gi: {ri: _stack([_stack([_without_engram(layers[group.layer(it, run.offset + j)])
                                       for j in range(run.count)]) for it in range(group.count)])
                   for ri, run in enumerate(group.runs)}
              for gi, group in enumerate(layer_groups(cfg))}
    moved = {k: v for k, v in tree.items() if k != "groups"} | {"groups": groups}
    if cfg.engram_layer_ids:
        moved["engram"] = {k: layers[layer]["engram"] for k, layer in enumerate(cfg.engram_layer_ids)}
    nnx.replace_by_pure_dict(like, jax.tree.map(jnp.asarray, moved))
    return like


def _without_engram(layer: dict) -> dict:
    return {k: v for k, v in layer.items() if k != "engram"}
