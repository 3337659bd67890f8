"""The training loop: batches → `train_step`, progress, JSON-lines metrics, checkpoints, loss curve.

Resuming is bit-identical: the batch at step k is a pure function of (seed, k), and the
checkpoint holds params, optimizer state, step, data position, config and RNG.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from typing import Callable, Iterator

import jax.numpy as jnp
import numpy as np

from csa2.config import ModelConfig
from csa2.checkpoints import native as checkpoint
from train.data import batches, eval_batches
from train.step import TrainConfig, TrainState, eval_loss, init_train_state, train_step

Batches = Callable[[int], Iterator[tuple[np.ndarray, np.ndarray, "np.ndarray | None"]]]  # start step → batches


def evaluate(cfg: ModelConfig, params: dict, tokens: np.ndarray, *, qat: bool, batch_size: int = 8,
             seq_len: int = 128) -> float:
    """Validation bits per byte over the whole stream (float numerics, or FP4/FP8 ones with `qat`)."""
    nats = count = 0.0
    for inputs, targets, mask in eval_batches(tokens, batch_size, seq_len):
        s, c = eval_loss(cfg, params, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(mask), qat)
        nats, count = nats + float(s), count + float(c)
    return nats / max(count, 1.0) / math.log(2)


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


def train(cfg: ModelConfig, tc: TrainConfig, data: np.ndarray | Batches, out: str | pathlib.Path, *,
          resume: bool = False, log: Callable[[str], None] = print, bar: bool = True, save_every: int = 0,
          until: int | None = None) -> TrainState:
    """Train up to step `until` (default `tc.steps`) of the `tc` schedule, from the latest checkpoint
    in `out` when `resume`; then save, write metrics.jsonl and plot the loss curve. `log` takes each step's
    metrics as a JSON line; `bar` draws a progress bar on stderr.

    `data` is a token stream (random windows of `tc.batch_size × tc.seq_len`, `train.data.batches`) or a
    `Batches` function: `data(start_step)` iterates `(inputs, targets, weights)` from that step on, each
    batch a pure function of its step (so resuming stays bit-identical) and of any shape (one compile per
    shape), e.g. the mixed long-context batches of `train.longctx`."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = init_train_state(cfg, tc)
    if resume:
        restored = checkpoint.restore(out, cfg, params_like=state.params, opt_state_like=state.opt_state)
        state = TrainState(params=restored["params"], opt_state=restored["opt_state"],
                           step=jnp.asarray(restored["step"], jnp.int32), rng=restored["rng"])
    first = int(state.step)
    if callable(data):
        stream = data(first)
    else:
        stream = ((x, y, None) for x, y in batches(data, tc.batch_size, tc.seq_len, seed=tc.seed, start_step=first))
    metrics_path = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()] if resume and metrics_path.exists() else []
    records = [r for r in records if r["step"] <= first]
    last = tc.steps if until is None else min(until, tc.steps)
    if first >= last:
        log(f"nothing to do: the checkpoint in {out} is at step {first} ≥ {last}")
    compiled = time.perf_counter()
    tokens = 0  # trained since the first (compiling) step
    for step in range(first, last):
        inputs, targets, weights = next(stream)
        state, metrics = train_step(cfg, tc.for_step(), state, jnp.asarray(inputs), jnp.asarray(targets),
                                    None if weights is None else jnp.asarray(weights),
                                    dense=step < tc.dense_warmup_steps, qat=tc.qat(step))
        metrics = {k: float(v) for k, v in metrics.items()}
        now = time.perf_counter()
        if step == first:  # the first step includes compilation: rates count from its end
            compiled = now
        else:
            tokens += inputs.size
        done = step - first
        rate = tokens / (now - compiled) if done else 0.0
        record = {"step": step + 1, **metrics, "tokens_per_s": rate}
        records.append(record)
        log(json.dumps(record))
        eta = (now - compiled) / done * (last - step - 1) if done else float("nan")
        if bar:
            progress(step + 1, last, f"loss {metrics['loss']:.3f} bpb {metrics['bpb']:.3f} "
                     f"kl {metrics['index_kl']:.4f} {rate:,.0f} tok/s", eta)
        if save_every and (step + 1) % save_every == 0 and step + 1 < last:
            _save(out, cfg, tc, state)
    if bar:
        sys.stderr.write("\n")
    _save(out, cfg, tc, state)
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    if records and not plot_losses(records, out / "loss.png"):
        log(f"no {out / 'loss.png'}: plotting needs the plot extra (pip install -e '.[plot]')")
    return state


def _save(out: pathlib.Path, cfg: ModelConfig, tc: TrainConfig, state: TrainState) -> None:
    step = int(state.step)
    checkpoint.save(out, step, params=state.params, opt_state=state.opt_state, data_step=step, rng=state.rng, cfg=cfg,
                    extra={"train_config": {k: v for k, v in vars(tc).items()}})

