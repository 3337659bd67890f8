"""DSpark adaptation (SPEC §12): train the drafter on a frozen backbone.

    python -m train.dspark --backbone DIR [--out DIR --steps N --anchors A --batch B --seq-len S --lr LR]
                           [--data corpus|greedy|sampled --stages N]

Each step takes a batch of windows `tokens [B, S]` of the embedded corpus and `A` anchors per row, drawn
without replacement from the row's valid anchor positions with the step's RNG (`fold_in(rng, step)`), so the
batch and the anchors at step k are pure functions of (seed, k) and a resumed run is the run that never
stopped. An anchor a is valid when the token it predicts first, `tokens[a + 1]`, is in the window and in a's
document (the corpus starts each document with BOS, `train.data`); a row with fewer valid positions than A
also draws invalid ones, whose slots the mask removes.

- **Data** (`data`). `corpus`: random windows of the corpus. `greedy` / `sampled`: self-distillation, rows
  the frozen target wrote itself from corpus prompts (`train.distill`: `distill_rows` rows of a
  `distill_prompt`-token prompt and its continuation, greedy or at `distill_temperature`), generated once
  and kept in the run directory as `pool.npy` (with its recipe in `pool.json`); batches are drawn from that pool. The
  drafter is scored on the target's own continuations at inference, so this is the data it is tested on.
- **Stages.** The drafter's stage count is its own (`csa2.checkpoints.native.DRAFTER_FIELDS`): `--stages 3`
  adapts the release's three stages on a backbone trained with one; the drafter checkpoint stores that
  config and `restore_with_drafter` puts the backbone under it.
- **Target.** The backbone runs teacher-forced (`model.forward(..., features=True)`) and its logits and
  DSpark features pass through `jax.lax.stop_gradient`; the loss is differentiated with respect to the
  drafter's subtree alone, so the backbone is frozen by construction, not by a zero learning rate.
  With `qat` (the default) the target runs the SPEC §8 fake-quant numerics and the drafter reads FP8
  context windows, as inference stores them.
- **Blocks.** `csa2.dspark.anchored`: block a holds `[tokens[a], noise × (γ−1)]`, sees the context
  strictly before the anchor, and its Markov inputs are the true tokens (teacher forcing). Slot k
  predicts `tokens[a + 1 + k]`; its target distribution is `p_target = softmax(target logits at row
  a + k)`. Slots with `a + 1 + k ≥ S` have no target in the window, and slots whose target lies in a later
  document than a (a BOS at or before it) would teach the drafter to continue across a document boundary:
  both are masked out (`block_mask`, as DeepSpec and NeMo mask a block by document).
- **Loss** (DeepSpec's objective): per slot `0.1·CE(draft, tokens[a+1+k]) + 0.9·‖p_draft − p_target‖₁
  + BCE(c_k, α_k)` with `α_k = stop_gradient(1 − ½‖p_draft − p_target‖₁)`, the probability that a
  stochastic verifier accepts the draft; averaged with weights `w_k = exp(−k/4)` (k 0-based) over the
  unmasked slots. α is a target for the confidence head only: no gradient flows into the draft through it.
- **Optimizer.** The backbone's (`train.step.optimizer`: AdamW, warmup + cosine, global-norm clipping)
  on the drafter's `nnx.Param`s only. Its MoE `RouterBias` variables are excluded by type and stay frozen
  at their values (the drafter has no balancing rule of its own here).
- **Metrics** (`metrics.jsonl`, one JSON line per logged step, and `dspark.png`): the loss and its
  three parts; per slot k the mean α_k (`accept`) and the greedy match rate argmax draft == argmax
  target (`greedy`); the mean accepted length `Σ_k Π_{j≤k} α_j` (`accept_len`) and its greedy
  counterpart (`greedy_accept_len`, leading greedy matches) over the anchors whose whole block lies in
  the window. Both are *teacher-forced* estimates: every slot sees the true previous token, whereas
  at inference a slot after a rejection never runs. `ece` is the expected calibration error of the
  confidence c_k against α_k (10 equal-width bins).
- **Checkpoints** hold the drafter alone (`csa2.checkpoints.native.save` of kind `DRAFTER_KIND`, with the
  model config, the optimizer state and the RNG); inference puts it into the backbone's params with
  `csa2.checkpoints.native.with_drafter` / `restore_with_drafter`.

`adapt` is the library entry (the CLI and `make demo` call it): this objective and `dspark_step` on the
shared loop (`train.loop.run`: metrics, progress, checkpoints, resume). Bad input raises ValueError naming
the field, its value and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from csa2 import dspark, model
from csa2.boundary import entry_point
from csa2.checkpoints import native as checkpoint
from csa2.checks import is_static_int
from csa2.config import ModelConfig
from csa2.mesh import PARAMS, REPLICATED, ROWS
from csa2.params import arrays
from csa2.presets import BOS_ID
from train.data import batches
from train.distill import continuations, pool_batches
from train.loop import Trainee, figure, host, run
from train.step import TrainState, optimizer, train_state_shardings

Array = jax.Array

ECE_BINS = 10
DATA = ("corpus", "greedy", "sampled")
POOL = "pool.npy"  # the self-distillation pool of a run, kept in its directory


@dataclasses.dataclass(frozen=True)
class DSparkTrainConfig:
    """The adaptation recipe (hashable: a static jit argument). Loss coefficients default to SPEC §12."""

    steps: int = 150
    batch_size: int = 8
    seq_len: int = 128
    anchors: int = 4  # blocks per row per step
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    bce_weight: float = 1.0
    position_decay: float = 4.0  # w_k = exp(−k / position_decay)
    qat: bool = True  # SPEC §8 numerics in the target's forward and the drafter's windows, as at inference
    data: str = "corpus"  # "corpus" windows, or the target's own "greedy" / "sampled" continuations (train.distill)
    distill_rows: int = 512  # rows of the self-distillation pool
    distill_prompt: int = 32  # corpus tokens each pool row starts from
    distill_temperature: float = 1.0  # the target's temperature for data="sampled"
    log_every: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        fixes = {"steps": "train at least one step (--steps)", "batch_size": "use at least one row (--batch)",
                 "anchors": "draft at least one block per row (--anchors, e.g. 4)",
                 "log_every": "log every step (1) or every few steps"}
        for name, fix in fixes.items():
            value = getattr(self, name)
            if not is_static_int(value) or value < 1:
                raise ValueError(f"DSparkTrainConfig.{name}={value!r}: must be an integer ≥ 1; {fix}")
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"DSparkTrainConfig.seq_len={self.seq_len!r}: must be an integer ≥ 2 (an anchor and the "
                             "token it predicts); use --seq-len 128")
        if self.anchors >= self.seq_len:
            raise ValueError(f"DSparkTrainConfig.anchors={self.anchors!r}: anchors are distinct positions of a "
                             f"{self.seq_len}-token window, so at most seq_len − 1 = {self.seq_len - 1}; use fewer "
                             "(--anchors) or a longer window (--seq-len)")
        for name in ("lr", "clip_norm", "position_decay"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DSparkTrainConfig.{name}={getattr(self, name)!r}: must be > 0")
        for name in ("weight_decay", "ce_weight", "l1_weight", "bce_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DSparkTrainConfig.{name}={getattr(self, name)!r}: must be ≥ 0")
        if self.data not in DATA:
            raise ValueError(f"DSparkTrainConfig.data={self.data!r}: choose one of {DATA} (--data)")
        if self.data != "corpus":
            if not isinstance(self.distill_rows, int) or self.distill_rows < 1:
                raise ValueError(f"DSparkTrainConfig.distill_rows={self.distill_rows!r}: must be an integer ≥ 1 "
                                 "(rows of the self-distillation pool, --distill-rows)")
            if not isinstance(self.distill_prompt, int) or not 1 <= self.distill_prompt < self.seq_len:
                raise ValueError(f"DSparkTrainConfig.distill_prompt={self.distill_prompt!r}: must be an integer in "
                                 f"[1, seq_len − 1 = {self.seq_len - 1}]: a pool row is the prompt and the target's "
                                 "continuation of it (--distill-prompt)")
            if self.data == "sampled" and not self.distill_temperature > 0:
                raise ValueError(f"DSparkTrainConfig.distill_temperature={self.distill_temperature!r}: sampled "
                                 "continuations need a temperature > 0; use data='greedy' for temperature 0")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"DSparkTrainConfig.warmup={self.warmup!r}: must be an integer ≥ 0 (steps of lr warmup)")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"DSparkTrainConfig.seed={self.seed!r}: must be an integer ≥ 0")


def check_backbone(cfg: ModelConfig) -> None:
    """ValueError unless `cfg` has a drafter and target layers to read features from."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg: expected a csa2.config.ModelConfig, got {type(cfg).__name__}")
    if not cfg.num_nextn_predict_layers:
        raise ValueError("ModelConfig.num_nextn_predict_layers=0: the backbone has no DSpark drafter to adapt; train "
                         "the backbone with a config that has num_nextn_predict_layers ≥ 1 (every preset has one)")
    if not cfg.dspark_target_layer_ids:
        raise ValueError("ModelConfig.dspark_target_layer_ids=(): the drafter has no target features to read; "
                         "name the target layers (the presets use the last three)")


# ---------------------------------------------------------------------------------------------
# The objective (pure, on arrays)

def position_weights(gamma: int, decay: float) -> Array:
    """w_k = exp(−k / decay), k = 0 … γ−1 [γ]."""
    return jnp.exp(-jnp.arange(gamma, dtype=jnp.float32) / decay)


def valid_anchors(tokens: Array) -> Array:
    """[B, S] bool: position a can anchor a block, i.e. `tokens[a + 1]` exists and is no BOS (same document)."""
    return jnp.pad(tokens[:, 1:] != BOS_ID, ((0, 0), (0, 1)))


def sample_anchors(key: Array, tokens: Array, anchors: int) -> Array:
    """Anchors [B, A] int32: A distinct positions per row of `tokens [B, S]`, uniform over the valid ones
    (`valid_anchors`; invalid positions fill in only when a row has fewer than A valid ones)."""
    u = jax.random.uniform(key, tokens.shape)
    return jax.lax.top_k(jnp.where(valid_anchors(tokens), 1.0 + u, u), anchors)[1].astype(jnp.int32)


def block_mask(tokens: Array, anchors: Array, gamma: int) -> Array:
    """[B, A, γ] bool: slot k of the block at a has a target, `tokens[a + 1 + k]`, in the window and in a's
    document (no BOS in `tokens[a + 1 … a + 1 + k]`); a slot after a masked one is masked too."""
    s = tokens.shape[1]
    doc = jnp.cumsum(tokens == BOS_ID, axis=1)  # [B, S]: document of each position
    targets = anchors[..., None] + 1 + jnp.arange(gamma, dtype=jnp.int32)  # [B, A, γ]
    at = lambda pos: jnp.take_along_axis(doc, jnp.clip(pos, 0, s - 1).reshape(doc.shape[0], -1), axis=1)  # noqa: E731
    same = at(targets).reshape(targets.shape) == at(anchors)[..., None]
    return (targets < s) & same


def _block_rows(anchors: Array, gamma: int, seq_len: int) -> Array:
    """Rows a + k [B, A, γ] whose target logits predict slot k, clipped into the window."""
    return jnp.clip(anchors[..., None] + jnp.arange(gamma, dtype=jnp.int32), 0, seq_len - 1)


def objective(dc: DSparkTrainConfig, draft_logits: Array, confidence: Array, target_logits: Array, tokens: Array,
              anchors: Array) -> tuple[Array, dict]:
    """(loss, metrics) of draft logits [B, A, γ, V] and confidences [B, A, γ] at `anchors [B, A]` against the
    target's logits [B, S, V] of `tokens [B, S]` (SPEC §12; see the module docstring). Metrics hold the three
    loss parts (position-weighted means), per-slot `accept` [γ] and `greedy` [γ], `accept_len`,
    `greedy_accept_len`, `ece`, `confidence` and `alpha` (means)."""
    b, a_n, gamma, _ = draft_logits.shape
    s = tokens.shape[1]
    rows, mask = _block_rows(anchors, gamma, s), block_mask(tokens, anchors, gamma)  # [B, A, γ]
    flat = rows.reshape(b, a_n * gamma)
    target = jnp.take_along_axis(target_logits, flat[..., None], axis=1).reshape(b, a_n, gamma, -1)
    labels = jnp.take_along_axis(tokens, jnp.clip(flat + 1, 0, s - 1), axis=1).reshape(b, a_n, gamma)
    p_target = jax.nn.softmax(jax.lax.stop_gradient(target).astype(jnp.float32), axis=-1)
    logp_draft = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    p_draft = jnp.exp(logp_draft)

    ce = -jnp.take_along_axis(logp_draft, labels[..., None], axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(p_draft - p_target), axis=-1)
    alpha = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    c = jnp.clip(confidence.astype(jnp.float32), 1e-7, 1.0 - 1e-7)
    bce = -(alpha * jnp.log(c) + (1.0 - alpha) * jnp.log1p(-c))

    m = mask.astype(jnp.float32)
    wm = position_weights(gamma, dc.position_decay) * m
    denom = jnp.maximum(jnp.sum(wm), 1e-9)
    ce_m, l1_m, bce_m = (jnp.sum(wm * x) / denom for x in (ce, l1, bce))
    loss = dc.ce_weight * ce_m + dc.l1_weight * l1_m + dc.bce_weight * bce_m

    per_slot = jnp.maximum(jnp.sum(m, axis=(0, 1)), 1.0)  # [γ]
    greedy = (jnp.argmax(draft_logits, -1) == jnp.argmax(target, -1)).astype(jnp.float32)
    full = m[..., -1]  # [B, A]: the whole block lies in the window
    n_full = jnp.maximum(jnp.sum(full), 1.0)
    count = jnp.maximum(jnp.sum(m), 1.0)
    bins = jnp.clip(jnp.floor(c * ECE_BINS).astype(jnp.int32), 0, ECE_BINS - 1)
    onehot = jax.nn.one_hot(bins, ECE_BINS) * m[..., None]  # [B, A, γ, bins]
    gap = jnp.sum(onehot * (c - alpha)[..., None], axis=(0, 1, 2))  # Σ_bin (c − α): |mean c − mean α| · n_bin
    metrics = {
        "ce": ce_m, "l1": l1_m, "bce": bce_m,
        "accept": jnp.sum(alpha * m, axis=(0, 1)) / per_slot,
        "greedy": jnp.sum(greedy * m, axis=(0, 1)) / per_slot,
        "accept_len": jnp.sum(jnp.sum(jnp.cumprod(alpha, axis=-1), -1) * full) / n_full,
        "greedy_accept_len": jnp.sum(jnp.sum(jnp.cumprod(greedy, axis=-1), -1) * full) / n_full,
        "ece": jnp.sum(jnp.abs(gap)) / count,
        "confidence": jnp.sum(c * m) / count,
        "alpha": jnp.sum(alpha * m) / count,
    }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# The step

def target(cfg: ModelConfig, backbone: nnx.State, tokens: Array, qat: bool) -> tuple[Array, Array]:
    """The frozen backbone on `tokens [B, S]`: logits [B, S, V] and DSpark features [B, S, n_t, d], both
    behind `stop_gradient`."""
    logits, aux = model.forward(cfg, backbone, tokens, qat=qat, features=True)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(aux["features"])


def losses(cfg: ModelConfig, dc: DSparkTrainConfig, drafter: nnx.State, backbone: nnx.State, tokens: Array,
           anchors: Array) -> tuple[Array, dict]:
    """(loss, metrics) of `drafter` at `anchors [B, A]` of `tokens [B, S]`; differentiable in `drafter` only."""
    target_logits, features = target(cfg, backbone, tokens, dc.qat)
    p = {**jax.lax.stop_gradient(arrays(backbone)), model.DRAFTER: arrays(drafter)}
    draft_logits, confidence = dspark.anchored(cfg, p, features, tokens, anchors, quantize=dc.qat)
    return objective(dc, draft_logits, confidence, target_logits, tokens, anchors)


def with_stages(cfg: ModelConfig, params: nnx.State, stages: int, seed: int) -> tuple[ModelConfig, nnx.State]:
    """(config, params) of the backbone `params` of `cfg` with a fresh drafter of `stages` draft stages."""
    if not is_static_int(stages) or stages < 1:
        raise ValueError(f"stages={stages!r}: a drafter has at least one draft stage (--stages 1 … ; the release "
                         "has 3)")
    cfg = cfg.replace(num_nextn_predict_layers=stages)
    return cfg, checkpoint.with_drafter(params, fresh_drafter(cfg, seed), cfg)


def fresh_drafter(cfg: ModelConfig, seed: int) -> nnx.State:
    """A newly initialized drafter: the `drafter` subtree of `model.init_params(cfg, PRNGKey(seed))`."""
    check_backbone(cfg)
    return model.init_params(cfg, jax.random.PRNGKey(seed))[model.DRAFTER]


def init_state(cfg: ModelConfig, dc: DSparkTrainConfig, drafter: nnx.State | None = None) -> TrainState:
    """Step 0: the drafter's subtree as the trained params (default `fresh_drafter(cfg, dc.seed)`), fresh AdamW
    state (`train.step.optimizer` on the drafter's `nnx.Param`s), the run's RNG."""
    # A copy: the step donates its state, and a caller's drafter may share buffers with params it still reads.
    drafter = fresh_drafter(cfg, dc.seed) if drafter is None else jax.tree.map(jnp.copy, drafter)
    return TrainState(params=drafter, opt_state=optimizer(dc, frozen=()).init(drafter),
                      step=jnp.zeros((), jnp.int32), rng=jax.random.fold_in(jax.random.PRNGKey(dc.seed), 1))


def _check_step(cfg, dc, state, backbone, tokens) -> None:
    if not isinstance(state, TrainState):
        raise ValueError(f"state: expected a train.step.TrainState of the drafter, got {type(state).__name__}")
    if jnp.ndim(tokens) != 2:
        raise ValueError(f"tokens.shape={jnp.shape(tokens)}: give a [B, S] token array")


@entry_point(_check_step, static_argnames=("cfg", "dc"), donate_argnames=("state",),
             place=dict(state=train_state_shardings, backbone=PARAMS, tokens=ROWS), out=("state", REPLICATED))
def dspark_step(cfg: ModelConfig, dc: DSparkTrainConfig, state: TrainState, backbone: nnx.State,
                tokens: Array) -> tuple[TrainState, dict]:
    """One update of the drafter (`state.params`) on `tokens [B, S]` with the step's anchors; the backbone is read,
    never changed. `dspark_step.on(mesh, rules)` is the step compiled for a mesh, placed as `train.step.train_step`
    (the drafter's parameters and moments by the rules, the backbone's by the rules, the rows over `data`)."""
    anchors = sample_anchors(jax.random.fold_in(state.rng, state.step), tokens, dc.anchors)
    (loss, metrics), grads = jax.value_and_grad(lambda d: losses(cfg, dc, d, backbone, tokens, anchors),
                                                has_aux=True)(state.params)
    updates, opt_state = optimizer(dc, frozen=()).update(grads, state.opt_state, state.params)
    drafter = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, **metrics, "grad_norm": optax.tree.norm(grads)}
    return TrainState(params=drafter, opt_state=opt_state, step=state.step + 1, rng=state.rng), metrics


@functools.partial(jax.jit, static_argnames=("cfg", "dc"))
def dspark_metrics(cfg: ModelConfig, dc: DSparkTrainConfig, drafter: nnx.State, backbone: nnx.State, tokens: Array,
                   key: Array) -> dict:
    """The step's metrics without an update (validation), anchors drawn from `key`."""
    loss, metrics = losses(cfg, dc, drafter, backbone, tokens, sample_anchors(key, tokens, dc.anchors))
    return {"loss": loss, **metrics}


# ---------------------------------------------------------------------------------------------
# The loop

def plot(records: list[dict], path: pathlib.Path) -> bool:
    """Loss parts, per-slot acceptance (first vs last logged step) and accepted length / ECE as a PNG;
    False (nothing written) without the `plot` extra (matplotlib)."""
    drawn = figure(3, (13, 3.4))
    if drawn is None:
        return False

    fig, axes = drawn
    steps = [r["step"] for r in records]
    for key, label in (("loss", "loss"), ("ce", "CE"), ("l1", "L1(p_draft, p_target)"), ("bce", "BCE(c, α)")):
        axes[0].plot(steps, [r[key] for r in records], label=label)
    axes[0].set(xlabel="step", ylabel="nats / L1", title="DSpark loss (SPEC §12)")
    axes[0].legend(fontsize=7)
    slots = np.arange(1, len(records[-1]["accept"]) + 1)
    for r, style in ((records[0], ":"), (records[-1], "-")):
        axes[1].plot(slots, r["accept"], "o" + style, color="C0", label=f"mean α, step {r['step']}")
        axes[1].plot(slots, r["greedy"], "s" + style, color="C1", label=f"greedy match, step {r['step']}")
    axes[1].set(xlabel="draft slot k+1", ylabel="rate", ylim=(0, 1), title="per-position acceptance")
    axes[1].legend(fontsize=7)
    axes[2].plot(steps, [r["accept_len"] for r in records], label="Σ Π α (teacher-forced)")
    axes[2].plot(steps, [r["greedy_accept_len"] for r in records], label="greedy leading matches")
    axes[2].set(xlabel="step", ylabel="accepted drafts per block", title="accepted length; ECE (right)")
    twin = axes[2].twinx()
    twin.plot(steps, [r["ece"] for r in records], color="C3", alpha=0.6, label="ECE")
    twin.set_ylabel("ECE")
    handles = axes[2].get_legend_handles_labels()
    twin_handles = twin.get_legend_handles_labels()
    axes[2].legend(handles[0] + twin_handles[0], handles[1] + twin_handles[1], fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def _pool(cfg: ModelConfig, dc: DSparkTrainConfig, params: nnx.State, corpus, out: pathlib.Path,
          log: Callable[[str], None]) -> np.ndarray:
    """The run's self-distillation pool: `out/pool.npy` when `out/pool.json` says it was made by this recipe, else
    generated by the target (`train.distill.continuations`) and saved there with its recipe."""
    path, meta = out / POOL, out / (pathlib.Path(POOL).stem + ".json")
    recipe = {k: getattr(dc, k) for k in ("data", "distill_rows", "distill_prompt", "distill_temperature", "seq_len",
                                          "seed")}
    if path.exists() and meta.exists():
        if json.loads(meta.read_text()) == recipe:
            return np.load(path)
        log(f"{path}: made by another recipe ({meta}); generating anew")
    t0 = time.perf_counter()
    pool = continuations(cfg, params, corpus, rows=dc.distill_rows, prompt_len=dc.distill_prompt,
                         seq_len=dc.seq_len, temperature=0.0 if dc.data == "greedy" else dc.distill_temperature,
                         seed=dc.seed)
    np.save(path, pool)
    meta.write_text(json.dumps(recipe) + "\n")
    log(f"# self-distillation pool ({dc.data}): {pool.shape[0]} rows of {dc.distill_prompt} corpus + "
        f"{dc.seq_len - dc.distill_prompt} target tokens in {time.perf_counter() - t0:.0f}s, saved {path}")
    return pool


def adapt(cfg: ModelConfig, backbone_params: nnx.State, tokens_array, dc: DSparkTrainConfig, out_dir, *,
          log: Callable[[str], None] = print, resume: bool = False, drafter: nnx.State | None = None,
          save_every: int = 0, until: int | None = None) -> nnx.State:
    """Adapt the drafter of `cfg` on the frozen `backbone_params` (full model params of `cfg`, e.g.
    `restore_params`'s; for another stage count than the backbone's, `checkpoint.with_drafter(backbone,
    fresh_drafter(cfg, seed), cfg)`) over random windows of `tokens_array` (a 1-D token stream), or over the
    target's continuations of its windows (`dc.data`), for up to step `until` (default `dc.steps`).

    Starts from `drafter` (default: a fresh one, `fresh_drafter(cfg, dc.seed)`), or from the latest drafter
    checkpoint in `out_dir` when `resume`. Writes drafter checkpoints, `metrics.jsonl` and `dspark.png` to
    `out_dir` and returns `backbone_params` with the adapted drafter in place (`checkpoint.with_drafter`).
    """
    check_backbone(cfg)
    if not isinstance(dc, DSparkTrainConfig):
        raise ValueError(f"dc: expected a train.dspark.DSparkTrainConfig, got {type(dc).__name__}")
    if not isinstance(backbone_params, nnx.State):
        raise ValueError(f"backbone_params: expected the model's nnx.State (model.init_params, "
                         f"checkpoint.restore_params), got {type(backbone_params).__name__}")
    if model.DRAFTER not in backbone_params:
        raise ValueError(f"backbone_params: no {model.DRAFTER!r} subtree; pass the full params of cfg "
                         "(model.init_params or checkpoint.restore_params), not the backbone's parameters alone")
    out = pathlib.Path(out_dir)

    def stream(first: int):
        if dc.data == "corpus":
            return (tokens for tokens, _ in batches(tokens_array, dc.batch_size, dc.seq_len, seed=dc.seed,
                                                    start_step=first))
        return pool_batches(_pool(cfg, dc, backbone_params, tokens_array, out, log), dc.batch_size, seed=dc.seed,
                            start_step=first)

    trainee = Trainee(
        kind=checkpoint.DRAFTER_KIND, steps=dc.steps, init=lambda: init_state(cfg, dc, drafter), batches=stream,
        step=lambda state, tokens, _: dspark_step(cfg, dc, state, backbone_params, jnp.asarray(tokens)),
        extra={"dspark_config": dataclasses.asdict(dc)},
        summary=lambda r: (f"loss {r['loss']:.3f} accept_len {r['accept_len']:.2f} greedy "
                           f"{r['greedy_accept_len']:.2f} ece {r['ece']:.3f}"),
        rate="steps_per_s", work=lambda _: 1, plot=plot, png="dspark.png", log_every=dc.log_every)
    state = run(trainee, cfg, out, resume=resume, log=log, save_every=save_every, until=until)
    return checkpoint.with_drafter(backbone_params, state.params)


def evaluate(cfg: ModelConfig, params: nnx.State, tokens_array, dc: DSparkTrainConfig, n_batches: int = 4) -> dict:
    """Mean metrics of the drafter in `params` over `n_batches` random windows of `tokens_array` (validation)."""
    data = batches(tokens_array, dc.batch_size, dc.seq_len, seed=dc.seed + 1)
    drafter, total = params[model.DRAFTER], None
    for i in range(n_batches):
        tokens, _ = next(data)
        m = host(dspark_metrics(cfg, dc, drafter, params, jnp.asarray(tokens), jax.random.PRNGKey(i)))
        total = m if total is None else {k: (np.add(total[k], v)) for k, v in m.items()}
    return {k: (np.asarray(v) / n_batches).tolist() for k, v in total.items()}


# ---------------------------------------------------------------------------------------------
# CLI

def parse(argv: list[str] | None) -> argparse.Namespace:
    d = DSparkTrainConfig()
    p = argparse.ArgumentParser(prog="python -m train.dspark", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", required=True, help="checkpoint directory of the backbone (python -m train --out)")
    p.add_argument("--backbone-step", type=int, default=None, help="backbone checkpoint step (default: latest)")
    p.add_argument("--out", default="runs/dspark", help="directory for drafter checkpoints, metrics.jsonl, dspark.png")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--anchors", type=int, default=d.anchors, help="blocks per row per step")
    p.add_argument("--batch", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--data", choices=DATA, default=d.data, help="corpus windows, or the target's own greedy / "
                   "sampled continuations of corpus prompts (self-distillation)")
    p.add_argument("--distill-rows", type=int, default=d.distill_rows, help="rows of the self-distillation pool")
    p.add_argument("--distill-prompt", type=int, default=d.distill_prompt, help="corpus tokens per pool row")
    p.add_argument("--distill-temperature", type=float, default=d.distill_temperature,
                   help="the target's temperature for --data sampled")
    p.add_argument("--stages", type=int, default=None, help="draft stages (default: the backbone config's; the "
                   "release has 3)")
    p.add_argument("--float", action="store_true", help="ablation: float target and float draft windows "
                   "(default: SPEC §8 numerics)")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches after training (0: none)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from the latest drafter checkpoint in --out")
    p.add_argument("--quiet", action="store_true", help="no JSON line per step on stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from train.data import load_corpus

    args = parse(argv)
    try:
        dc = DSparkTrainConfig(steps=args.steps, batch_size=args.batch, seq_len=args.seq_len, anchors=args.anchors,
                               lr=args.lr, warmup=args.warmup, qat=not args.float, data=args.data,
                               distill_rows=args.distill_rows, distill_prompt=args.distill_prompt,
                               distill_temperature=args.distill_temperature, log_every=args.log_every,
                               seed=args.seed)
        if args.eval_batches < 0:
            raise ValueError(f"--eval-batches={args.eval_batches}: must be ≥ 0 (0 skips validation)")
        if not os.path.isdir(args.backbone):
            raise ValueError(f"--backbone={args.backbone!r}: no such directory; pass the --out directory of "
                             "python -m train (e.g. runs/demo after make demo)")
        cfg, backbone = checkpoint.restore_params(args.backbone, step=args.backbone_step)
        check_backbone(cfg)
        if args.stages is not None:
            cfg, backbone = with_stages(cfg, backbone, args.stages, dc.seed)
        corpus = load_corpus()
        params = adapt(cfg, backbone, corpus.train, dc, args.out, resume=args.resume, save_every=args.save_every,
                       log=(lambda _: None) if args.quiet else print)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.eval_batches:
        m = evaluate(cfg, params, corpus.valid, dc, args.eval_batches)
        print(f"# validation ({args.eval_batches}×{dc.batch_size}×{dc.anchors} blocks): per-slot mean α "
              + " ".join(f"{x:.2f}" for x in m["accept"]) + ", greedy match "
              + " ".join(f"{x:.2f}" for x in m["greedy"]))
        print(f"accept_len: {m['accept_len']:.4f}")
        print(f"greedy_accept_len: {m['greedy_accept_len']:.4f}")
        print(f"ece: {m['ece']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
