"""Rematerialization of the layer stack in training: what the backward pass keeps of each layer.

Without it (`"none"`) the backward pass keeps every intermediate of every layer, the activation memory of a
train step. A policy wraps each scanned layer body in `jax.checkpoint`, so the backward pass recomputes the
layer from what the policy keeps:

- `"layer"`: nothing inside the layer; only its input (the scan carry: residual streams, `pre`, the bus) is
  kept, and the whole layer runs again in the backward pass (about one more forward).
- `"attention_moe"`: also the two named save points, each layer's attention output (`ATTENTION_OUT`, `[B, T, d]`
  after the output projection) and its MoE routing (`MOE_ROUTING`: the top-k experts and their weights). The
  recomputation then takes the attention output and the routing as they were (the router's top-k does not run
  again); the attention's own backward pass still recomputes its core, whose internals are not save points.

A policy recomputes the same operations on the same inputs, so the values do not change; XLA fuses the
recomputing program differently, so float sums may round differently (`tests/train/test_memory.py` bounds it).
Under FSDP (`csa2.mesh`) only a policy frees each layer's gathered weights after the layer: with `"none"` the
backward pass keeps them all.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax

ATTENTION_OUT = "attention_out"
MOE_ROUTING = "moe_routing"
POLICIES = ("none", "layer", "attention_moe")

F = TypeVar("F", bound=Callable)


def check(policy: str, what: str = "remat") -> None:
    if policy not in POLICIES:
        raise ValueError(f"{what}={policy!r}: use one of {POLICIES} ('none' keeps every activation)")


def wrap(body: F, policy: str, *, scanned: bool) -> F:
    """`body` (one layer) rematerialized by `policy`. `scanned`: the body is a `lax.scan` body, where XLA cannot
    merge the recomputation into the forward pass, so common-subexpression elimination may stay on; a body run
    once outside a loop keeps it off (`jax.checkpoint`'s `prevent_cse`)."""
    check(policy)
    if policy == "none":
        return body
    keep = (jax.checkpoint_policies.nothing_saveable if policy == "layer"
            else jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, MOE_ROUTING))
    return jax.checkpoint(body, prevent_cse=not scanned, policy=keep)
