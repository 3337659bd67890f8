"""The pure training step: LM loss + indexer KL (SPEC §13), AdamW, aux-loss-free MoE balancing (SPEC §9).

`train_step(cfg, tc, state, inputs, targets)` is one jitted update. Training runs the SPEC §8 numerics by
default (`TrainConfig.qat_from = 0`: fake-quant from the first step); float is the ablation. The MoE correction biases
are `RouterBias` variables, which the optimizer leaves alone by type; after each step they move by
`csa2.model.update_router_bias` from the step's measured expert loads.

`train_step.on(mesh, rules)` is the step compiled for a device mesh (`csa2.boundary.EntryPoint.on`): explicit
shardings for the whole `TrainState` (`train_state_shardings`: parameters by the rules, each optimizer moment like
its parameter), the batch split over `data`; the loads it balances by are summed over the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Protocol

import chex
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from csa2 import model, remat as remat_lib
from csa2.boundary import entry_point
from csa2.config import ModelConfig
from csa2.index_loss import IndexLoss
from csa2.mesh import PARAMS, REPLICATED, ROWS, Rules, replicated
from csa2.params import compute_weights
from csa2.replay import EXACT, ReplayPolicy

Array = jax.Array


DTYPE_POLICIES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimization recipe (hashable: a static jit argument)."""

    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    index_loss_weight: float = 1.0
    dense_warmup_steps: int = 0  # steps whose indexer KL uses every visible entry (SPEC §13 recipe)
    bias_rate: float = 1e-3
    qat_from: int | None = 0  # from this step on, SPEC §8 fake-quant (straight-through); None = float (ablation)
    replay_window: int | None = None  # train on the decoder tail of SPEC §11 (None = every position)
    remat: str = "none"  # what the backward pass keeps of each layer (`csa2.remat`): "none", "layer", "attention_moe"
    dtype_policy: str = "float32"  # "bfloat16": bf16 weights and compute on float32 master weights (`policy_forward`)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)}: must be ≥ 1")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr={self.lr}: must be > 0")
        if self.qat_from is not None and not 0 <= self.qat_from < self.steps:
            raise ValueError(f"TrainConfig.qat_from={self.qat_from}: use a step in [0, steps={self.steps}) "
                             "(0 = SPEC §8 numerics throughout), or None to train in float")
        remat_lib.check(self.remat, "TrainConfig.remat")
        if self.dtype_policy not in DTYPE_POLICIES:
            raise ValueError(f"TrainConfig.dtype_policy={self.dtype_policy!r}: use one of {DTYPE_POLICIES} "
                             "('float32': the model's own compute dtype, float32 weights)")
        if self.replay_window is not None and self.replay_window < 1:
            raise ValueError(f"TrainConfig.replay_window={self.replay_window}: use ≥ 1, or None for no replay")

    def qat(self, step: int) -> bool:
        """Whether step `step` (0-based) runs the SPEC §8 fake-quant forward."""
        return self.qat_from is not None and step >= self.qat_from

    def for_step(self) -> TrainConfig:
        """The config `train_step` compiles against: `qat_from` is the loop's schedule (the step takes `qat` per
        call), so configs that differ only in it share their compiled steps."""
        return dataclasses.replace(self, qat_from=0)

    @property
    def replay(self) -> ReplayPolicy:
        return EXACT if self.replay_window is None else ReplayPolicy(window=self.replay_window)


@chex.dataclass(frozen=True)
class TrainState:
    """What a trainee's run holds and resumes from (`train.loop.run`)."""

    params: nnx.State  # the trained tree: the model's params, or the drafter's subtree (`train.dspark`)
    opt_state: optax.OptState
    step: Array  # int32 scalar
    rng: Array


class Schedule(Protocol):
    """The fields `optimizer` reads of a recipe (`TrainConfig`, `train.dspark.DSparkTrainConfig`)."""

    steps: int
    lr: float
    warmup: int
    weight_decay: float
    clip_norm: float


def _labels(params: nnx.State, frozen: tuple[str, ...] = (model.DRAFTER,)) -> nnx.State:
    """"adamw" for every `nnx.Param` outside the subtrees `frozen` (top-level keys); "frozen" for those subtrees and
    for every other variable type (the MoE `RouterBias`). The backbone's trainer freezes the DSpark drafter's
    subtree, which `train.dspark` adapts on the trained backbone."""
    def label(path, v):
        skipped = bool(path) and getattr(path[0], "key", None) in frozen
        return "adamw" if isinstance(v, nnx.Param) and not skipped else "frozen"

    return jax.tree_util.tree_map_with_path(label, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer(oc: Schedule, frozen: tuple[str, ...] = (model.DRAFTER,)) -> optax.GradientTransformation:
    """AdamW with warmup + cosine decay and global-norm clipping on the `nnx.Param`s of the tree it updates, but
    those of the top-level subtrees `frozen`: the backbone's params without its drafter (the default), or the
    drafter's own subtree with `frozen=()` (`train.dspark`)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, oc.lr, min(oc.warmup, oc.steps - 1), oc.steps, oc.lr * 0.1)
    adamw = optax.chain(optax.clip_by_global_norm(oc.clip_norm),
                        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=oc.weight_decay))
    return optax.multi_transform({"adamw": adamw, "frozen": optax.set_to_zero()},
                                 functools.partial(_labels, frozen=frozen))


def init_train_state(cfg: ModelConfig, tc: TrainConfig) -> TrainState:
    key, rng = jax.random.split(jax.random.PRNGKey(tc.seed))
    params = model.init_params(cfg, key)
    return TrainState(params=params, opt_state=optimizer(tc).init(params), step=jnp.zeros((), jnp.int32), rng=rng)


def policy_forward(cfg: ModelConfig, tc: TrainConfig, params: nnx.State) -> tuple[ModelConfig, nnx.State]:
    """The config and weights the forward pass runs with under `tc.dtype_policy`. "float32": as given (weights
    float32, the config's compute dtype). "bfloat16": compute dtype bfloat16 and the compute weights cast to it
    (`csa2.params.compute_weights`; SPEC's float32 parameters and scopes stay float32). The cast sits inside the
    differentiated function, so gradients come back float32 to the float32 weights the optimizer holds (master
    weights), and on a model whose compute dtype is already bfloat16 the two policies give the same values."""
    if tc.dtype_policy == "float32":
        return cfg, params
    return cfg.replace(dtype="bfloat16"), compute_weights(params, "bfloat16")


def _index_layers(cfg: ModelConfig) -> int:
    return max(1, len(cfg.index_source_layer_ids))


def _nll(logits: Array, targets: Array) -> Array:
    """Per-position next-token cross-entropy (nats)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def token_loss(logits: Array, targets: Array, mask: Array) -> Array:
    """Mean next-token cross-entropy (nats) weighted by `mask` (0/1, or per-token loss weights)."""
    return jnp.sum(_nll(logits, targets) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def losses(cfg: ModelConfig, tc: TrainConfig, params: nnx.State, inputs: Array, targets: Array, weights: Array | None,
           dense: bool, qat: bool):
    """(total, aux): LM cross-entropy (weighted by `weights [B, L]`, uniform when None) on the rows that reach
    the head, plus the weighted indexer KL."""
    logits, aux = model.forward(cfg, params, inputs, qat=qat, replay=tc.replay,
                                instrument=IndexLoss("dense" if dense else "sparse"), remat=tc.remat)
    rows = aux["rows"]  # [B, T]: all rows, or the decoder tail under replay
    mask = jnp.ones(rows.shape, jnp.float32) if weights is None else jnp.take_along_axis(weights, rows, axis=1)
    lm = token_loss(logits, jnp.take_along_axis(targets, rows, axis=1), mask)
    kl = jnp.sum(aux["tap"]) / _index_layers(cfg)  # the indexer KL of each layer (0 off the index sources)
    return lm + tc.index_loss_weight * kl, {"lm": lm, "index_kl": kl, "load": aux["load"]}


def train_state_shardings(state: TrainState, mesh: jax.sharding.Mesh, rules: Rules, what: str = "state") -> TrainState:
    """The placement of a `TrainState` (`csa2.mesh`): parameters by the rules, each optimizer moment like the
    parameter it follows (optax mirrors the parameter tree, so a moment's path ends with its parameter's), the
    optimizer's counts, the step and the rng replicated."""
    params = PARAMS(state.params, mesh, rules, f"{what}.params")
    rep = replicated(mesh)
    by_path = {path: s for path, s in jax.tree_util.tree_flatten_with_path(params)[0]}

    def like_its_parameter(path, _):
        return next((by_path[path[i:]] for i in range(len(path)) if path[i:] in by_path), rep)

    opt_state = jax.tree_util.tree_map_with_path(like_its_parameter, state.opt_state)
    return TrainState(params=params, opt_state=opt_state, step=rep, rng=rep)


def _check_step(cfg, tc, state, inputs, targets, weights, dense, qat) -> None:
    if not isinstance(state, TrainState):
        raise ValueError(f"state: expected a train.step.TrainState, got {type(state).__name__}")
    if jnp.ndim(inputs) != 2 or jnp.shape(targets) != jnp.shape(inputs):
        raise ValueError(f"inputs.shape={jnp.shape(inputs)}, targets.shape={jnp.shape(targets)}: give two [B, L] "
                         "token arrays of one shape")
    if weights is not None and jnp.shape(weights) != jnp.shape(inputs):
        raise ValueError(f"weights.shape={jnp.shape(weights)}: give one loss weight per target, {jnp.shape(inputs)}")


def _loss_of(cfg: ModelConfig, tc: TrainConfig, fixed: nnx.State, inputs: Array, targets: Array,
             weights: Array | None, dense: bool, qat: bool) -> Callable:
    """The train step's loss as a function of the trained `nnx.Param`s (`fixed`: the rest of the parameters)."""
    def loss(trained):
        run_cfg, run_params = policy_forward(cfg, tc, nnx.merge_state(trained, fixed))
        return losses(run_cfg, tc, run_params, inputs, targets, weights, dense, qat)
    return loss


def saved_for_backward(cfg: ModelConfig, tc: TrainConfig, state: TrainState, inputs: Array, targets: Array,
                       weights: Array | None = None, dense: bool = False, qat: bool = True) -> list[Array]:
    """What the backward pass of `train_step` keeps from its forward pass under `tc.remat` (and the dtype policy):
    the residuals of the loss's VJP other than the step's own arguments, which are held anyway. Trace it (e.g.
    `jax.jit(...).lower(...)` on a mesh) to size what a remat policy keeps (`train.plan`)."""
    trained, fixed = nnx.split_state(state.params, nnx.Param, ...)
    loss = _loss_of(cfg, tc, fixed, inputs, targets, weights, dense, qat)
    _, pullback = jax.vjp(lambda p: loss(p)[0], trained)
    given = {id(x) for x in jax.tree.leaves((state, inputs, targets, weights))}
    return [x for x in jax.tree.leaves(pullback) if id(x) not in given]


@entry_point(_check_step, static_argnames=("cfg", "tc", "dense", "qat"), donate_argnames=("state",),
             place=dict(state=train_state_shardings, inputs=ROWS, targets=ROWS, weights=ROWS),
             out=("state", REPLICATED))
def train_step(cfg: ModelConfig, tc: TrainConfig, state: TrainState, inputs: Array, targets: Array,
               weights: Array | None = None, dense: bool = False, qat: bool = True) -> tuple[TrainState, dict]:
    """One update on a batch `inputs, targets [B, L]`; returns the new state and scalar metrics.

    `weights [B, L]`: per-token loss weights (None = uniform; e.g. the answer digits of a retrieval
    example weigh more, `train.longctx`); `dense`: indexer KL over every visible entry (warm-up);
    `qat`: the SPEC §8 fake-quant forward (False = the float ablation). `metrics["loss"]` is the weighted mean.
    """
    trained, fixed = nnx.split_state(state.params, nnx.Param, ...)  # only Params are differentiated
    loss = _loss_of(cfg, tc, fixed, inputs, targets, weights, dense, qat)
    (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(trained)
    grads = nnx.merge_state(grads, jax.tree.map(jnp.zeros_like, fixed))  # zeros where the optimizer leaves alone
    updates, opt_state = optimizer(tc).update(grads, state.opt_state, state.params)
    params = model.update_router_bias(cfg, optax.apply_updates(state.params, updates), aux["load"], tc.bias_rate)
    load = aux["load"]
    metrics = {
        "loss": aux["lm"],
        "bpb": aux["lm"] / math.log(2),
        "index_kl": aux["index_kl"],
        "grad_norm": optax.tree.norm(grads),
        "max_load": jnp.mean(jnp.max(load, axis=-1)) * cfg.n_routed_experts,  # 1.0 = perfectly balanced
    }
    return TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=state.rng), metrics


@functools.partial(jax.jit, static_argnames=("cfg", "qat"))
def eval_loss(cfg: ModelConfig, params: nnx.State, inputs: Array, targets: Array, mask: Array,
              qat: bool) -> tuple[Array, Array]:
    """(summed nats, counted tokens) of a masked eval batch, every position through every layer."""
    logits, _ = model.forward(cfg, params, inputs, qat=qat)
    return jnp.sum(_nll(logits, targets) * mask), jnp.sum(mask)
