"""The training loop: batches → a step function, progress, JSON-lines metrics, checkpoints, a figure.

`run` drives any `Trainee`: the backbone (`train`: `train_step`, loss.png) and the DSpark drafter
(`train.dspark.adapt`). Resuming is bit-identical: the batch at step k is a pure function of (seed, k), and
the checkpoint (`csa2.checkpoints.native`, of the trainee's kind) holds params, optimizer state, step, data
position, config and RNG.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from csa2.checkpoints import native as checkpoint
from csa2.config import ModelConfig
from train.data import batches, eval_batches
from train.step import TrainConfig, TrainState, eval_loss, init_train_state, train_step

Batches = Callable[[int], Iterator[tuple[np.ndarray, np.ndarray, "np.ndarray | None"]]]  # start step → batches


def eval_bits(cfg: ModelConfig, params: dict, tokens: np.ndarray, *, qat: bool, batch_size: int = 8,
              seq_len: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """(bits, bytes) of each `batch_size × seq_len` validation batch over the whole stream, in order (float
    numerics, or FP4/FP8 ones with `qat`): the per-batch sums that `evaluate` pools."""
    bits, count = [], []
    for inputs, targets, mask in eval_batches(tokens, batch_size, seq_len):
        s, c = eval_loss(cfg, params, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(mask), qat)
        bits.append(float(s) / math.log(2))
        count.append(float(c))
    return np.asarray(bits), np.asarray(count)


def evaluate(cfg: ModelConfig, params: dict, tokens: np.ndarray, *, qat: bool, batch_size: int = 8,
             seq_len: int = 128) -> float:
    """Validation bits per byte over the whole stream (float numerics, or FP4/FP8 ones with `qat`)."""
    bits, count = eval_bits(cfg, params, tokens, qat=qat, batch_size=batch_size, seq_len=seq_len)
    return float(bits.sum() / max(count.sum(), 1.0))


def progress(step: int, total: int, fields: str, eta: float) -> None:
    """A one-line progress bar on stderr: step of total, the caller's `fields`, the time left."""
    width = 24
    filled = int(width * step / total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {step}/{total} {fields} ETA {eta:,.0f}s ")
    sys.stderr.flush()


def figure(ncols: int, figsize: tuple[float, float]):
    """(figure, axes) of one row of `ncols` plots, drawn off-screen, or None without the `plot` extra
    (`pip install -e '.[plot]'`). A bare `matplotlib.figure.Figure`: the process's pyplot backend is left
    alone, so a notebook that trains still shows its own plots inline."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(1, ncols)


def plot_losses(records: list[dict], path: pathlib.Path) -> bool:
    """Loss and indexer-KL curves as a PNG; False (nothing written) without the `plot` extra (matplotlib)."""
    drawn = figure(2, (9, 3.2))
    if drawn is None:
        return False

    fig, axes = drawn
    steps = [r["step"] for r in records]
    axes[0].plot(steps, [r["bpb"] for r in records])
    axes[0].set(xlabel="step", ylabel="train bits per byte", title="LM loss")
    axes[1].plot(steps, [r["index_kl"] for r in records])
    axes[1].set(xlabel="step", ylabel="KL (nats)", title="indexer KL (SPEC §13)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def host(metrics: dict) -> dict:
    """Metrics as JSON values: scalars as floats, per-slot arrays as lists."""
    out = {}
    for k, v in metrics.items():
        v = np.asarray(v)
        out[k] = float(v) if v.ndim == 0 else [float(x) for x in v]
    return out


@dataclasses.dataclass(frozen=True)
class Trainee:
    """One kind of training run, as `run` drives it: `train` builds the backbone's, `train.dspark.adapt` the
    drafter's. Every batch is a pure function of its step, so resuming is the run that never stopped."""

    kind: str  # the checkpoints' kind (csa2.checkpoints.native.KINDS)
    steps: int  # the schedule's length
    init: Callable[[], TrainState]  # step 0; its shapes are also what a resumed run restores
    batches: Callable[[int], Iterator]  # start step → the batches from that step on
    step: Callable[[TrainState, object, int], tuple[TrainState, dict]]  # (state, batch, step index) → update
    extra: dict  # the recipe, stored with every checkpoint
    summary: Callable[[dict], str]  # a logged record → the progress bar's fields
    rate: str  # the record field of the throughput ...
    work: Callable[[object], int]  # ... counted per batch (tokens, or 1 per step)
    plot: Callable[[list[dict], pathlib.Path], bool]  # records → a PNG (False without the plot extra) ...
    png: str  # ... of this name in the run directory
    log_every: int = 1  # steps between logged records (the last step is always logged)


class NonFiniteLoss(ValueError):
    """Training produced a NaN or infinite loss; nothing after the last good checkpoint was saved."""


def run(trainee: Trainee, cfg: ModelConfig, out: str | pathlib.Path, *, resume: bool = False,
        log: Callable[[str], None] = print, bar: bool = True, save_every: int = 0,
        until: int | None = None) -> TrainState:
    """Train up to step `until` (default `trainee.steps`) of the schedule, from the latest checkpoint in `out` when
    `resume`; then save, write metrics.jsonl (also with every intermediate checkpoint) and the trainee's figure. `log`
    takes each logged step's record as a JSON line; `bar` draws a progress bar on stderr. A directory holding
    checkpoints of another kind or config is refused before any step runs. A non-finite loss at a logged or saved step
    raises `NonFiniteLoss` before anything is saved, so the last checkpoint on disk stays the last good one."""
    out = pathlib.Path(out)
    checkpoint.check_dir(out, cfg, trainee.kind)
    out.mkdir(parents=True, exist_ok=True)
    if resume:
        like = jax.eval_shape(trainee.init)
        restored = checkpoint.restore(out, cfg, kind=trainee.kind, params_like=like.params,
                                      opt_state_like=like.opt_state)
        state = TrainState(params=restored["params"], opt_state=restored["opt_state"],
                           step=jnp.asarray(restored["step"], jnp.int32), rng=restored["rng"])
    else:
        state = trainee.init()
    first = int(state.step)
    stream = trainee.batches(first)
    metrics_path = out / "metrics.jsonl"
    records = ([json.loads(line) for line in metrics_path.read_text().splitlines()]
               if resume and metrics_path.exists() else [])
    records = [r for r in records if r["step"] <= first]
    last = trainee.steps if until is None else min(until, trainee.steps)
    if first >= last:
        log(f"nothing to do: the {trainee.kind} checkpoint in {out} is at step {first} ≥ {last}")
    compiled = time.perf_counter()
    work = 0  # done since the first (compiling) step
    saved = first if resume else None  # the last step on disk that this run may fall back to
    for step in range(first, last):
        batch = next(stream)
        state, metrics = trainee.step(state, batch, step)
        done = step + 1
        if step == first:  # the first step includes compilation: rates count from its end
            jax.block_until_ready(metrics)
            compiled = time.perf_counter()
        else:
            work += trainee.work(batch)
        logged = done % trainee.log_every == 0 or done == last
        saving = save_every and done % save_every == 0 and done < last
        if logged or saving:
            loss = float(np.asarray(metrics["loss"]))
            if not math.isfinite(loss):
                _write_records(metrics_path, records)
                raise NonFiniteLoss(f"{trainee.kind} training stopped at step {done}: the loss is {loss}. Nothing "
                                    "was saved after it; " + (f"the checkpoint at step {saved} in {out} is the last "
                                                              "good one (resume from it with a lower learning rate)"
                                                              if saved is not None else "no checkpoint was written")
                                    + "; metrics.jsonl holds the steps before")
        if logged:
            record = {"step": done, **host(metrics)}
            elapsed = time.perf_counter() - compiled
            record[trainee.rate] = work / elapsed if step > first else 0.0
            records.append(record)
            log(json.dumps(record))
            if bar:
                progress(done, last, trainee.summary(record),
                         elapsed / (step - first) * (last - done) if step > first else float("nan"))
        if saving:  # the records go with each checkpoint, so a killed run keeps those its resume starts from
            _save(out, cfg, trainee, state)
            _write_records(metrics_path, records)
            saved = done
    if bar:
        sys.stderr.write("\n")
    _save(out, cfg, trainee, state)
    _write_records(metrics_path, records)
    if records and not trainee.plot(records, out / trainee.png):
        log(f"no {out / trainee.png}: plotting needs the plot extra (pip install -e '.[plot]')")
    return state


def _write_records(path: pathlib.Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _save(out: pathlib.Path, cfg: ModelConfig, trainee: Trainee, state: TrainState) -> None:
    step = int(state.step)
    checkpoint.save(out, step, kind=trainee.kind, params=state.params, opt_state=state.opt_state, rng=state.rng,
                    data_step=step, cfg=cfg, extra=trainee.extra)


def train(cfg: ModelConfig, tc: TrainConfig, data: np.ndarray | Batches, out: str | pathlib.Path, *,
          resume: bool = False, log: Callable[[str], None] = print, bar: bool = True, save_every: int = 0,
          until: int | None = None) -> TrainState:
    """Train the backbone up to step `until` (default `tc.steps`) of the `tc` schedule (`run`: from the latest
    checkpoint in `out` when `resume`; then save, write metrics.jsonl and plot the loss curve as loss.png).

    `data` is a token stream (random windows of `tc.batch_size × tc.seq_len`, `train.data.batches`) or a
    `Batches` function: `data(start_step)` iterates `(inputs, targets, weights)` from that step on, each
    batch a pure function of its step (so resuming stays bit-identical) and of any shape (one compile per
    shape), e.g. the mixed long-context batches of `train.longctx`."""
    if callable(data):
        stream = data
    else:
        def stream(first: int):
            return ((x, y, None) for x, y in batches(data, tc.batch_size, tc.seq_len, seed=tc.seed, start_step=first))

    compiled_tc = tc.for_step()

    def step(state: TrainState, batch, index: int):
        inputs, targets, weights = batch
        return train_step(cfg, compiled_tc, state, jnp.asarray(inputs), jnp.asarray(targets),
                          None if weights is None else jnp.asarray(weights),
                          dense=index < tc.dense_warmup_steps, qat=tc.qat(index))

    trainee = Trainee(
        kind=checkpoint.BACKBONE, steps=tc.steps, init=lambda: init_train_state(cfg, tc), batches=stream, step=step,
        extra={"train_config": dict(vars(tc))},
        summary=lambda r: (f"loss {r['loss']:.3f} bpb {r['bpb']:.3f} kl {r['index_kl']:.4f} "
                           f"{r['tokens_per_s']:,.0f} tok/s"),
        rate="tokens_per_s", work=lambda batch: batch[0].size, plot=plot_losses, png="loss.png")
    return run(trainee, cfg, out, resume=resume, log=log, bar=bar, save_every=save_every, until=until)
