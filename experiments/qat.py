"""Float vs the SPEC §8 numerics (FP4 Global KV and indexer, FP8 windows): how large the gap is and what
quantization-aware training recovers, on several seeds.

- `ablation`: one model trained three ways from the same initialization and data (float throughout, QAT, the
  training default, throughout, float then QAT for the last steps) on each seed, each scored under both numerics.
  Intervals over seeds (Student's t), runs compared per seed (a seed fixes the initialization and the batches).
- `numerics_gap`: one checkpoint's validation bits per byte under both numerics and their difference, window by
  window on the same windows (bootstrap over windows).
- `qat_vs_float`: the long-context recipe trained with QAT and in float on each seed, its pass keys scored while it
  trains (`experiments.recipe_ablations.ablate`: the same runs, recorded in the same ledger).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable

import numpy as np

from csa2.checkpoints import native as checkpoint
from csa2.config import ModelConfig
from experiments import recipe_ablations
from infer import stats
from infer.schedule import config_fingerprint
from train import longctx
from train.longctx import claim
from train.loop import eval_bits, evaluate, train
from train.step import TrainConfig

RUNS = ("float", "qat", "float → qat")


@dataclasses.dataclass(frozen=True)
class Ablation:
    """The three training runs of `ablation` (per seed): `steps` of `batch_size × seq_len` windows of the corpus;
    the third switches to QAT at `switch`."""

    steps: int = 160
    batch_size: int = 8
    seq_len: int = 128
    switch: int = 120

    def config(self, run: str, seed: int) -> TrainConfig:
        qat_from = {"float": None, "qat": 0, "float → qat": self.switch}[run]
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, qat_from=qat_from,
                           seed=seed)


# CI sizes: the fp4_qat notebook's fast mode (on `mini`) and its test run exactly this, so within one test run
# the notebook's kernel loads the programs the test compiled (tests/conftest.py's compilation cache).
FAST = Ablation(steps=2, batch_size=1, seq_len=16, switch=1)
FAST_PRESET = "mini"


def ablation(cfg: ModelConfig, train_tokens: np.ndarray, valid_tokens: np.ndarray, spec: Ablation,
             seeds: tuple[int, ...], out: str | pathlib.Path) -> dict:
    """{"runs": {run: {seed: {"float": val bpb, "fp4": val bpb}}}, "across_seeds": {run: {"float", "fp4", "gap":
    t interval over the seeds (gap: fp4 − float of each seed's run)}}, "vs_first": {run: {"float", "fp4": t interval
    of the per-seed difference to the first run}}} for the runs of `spec` on each of `seeds` (keys are strings, as in
    JSON; None with one seed). Each run trains into `out/seed<k>/<n>` (a finished run there is reused, a partial one
    resumed); a directory is keyed on its whole recipe (the run, the model config's fingerprint and every training
    field, in `recipe.json`): one of another recipe, or one with a checkpoint but no recipe, is refused."""
    runs = {}
    for i, run in enumerate(RUNS):
        runs[run] = {}
        for seed in seeds:
            config = spec.config(run, seed)
            path = pathlib.Path(out) / f"seed{seed}" / str(i)
            claim(path, {"run": run, "config": config_fingerprint(cfg), **dataclasses.asdict(config)})
            state = train(cfg, config, train_tokens, path, resume=checkpoint.latest_step(path) is not None,
                          log=lambda _: None, bar=False)
            runs[run][str(seed)] = {numerics: evaluate(cfg, state.params, valid_tokens, qat=numerics == "fp4",
                                                       seq_len=spec.seq_len) for numerics in ("float", "fp4")}
    # Six decimals: the FP4/FP8 gaps of these models are of order 1e-4 bits per byte.
    by_numerics = {numerics: recipe_ablations.across_seeds(
        {run: {seed: r[numerics] for seed, r in by_seed.items()} for run, by_seed in runs.items()}, digits=6)
        for numerics in ("float", "fp4")}
    gaps = recipe_ablations.across_seeds(
        {run: {seed: r["fp4"] - r["float"] for seed, r in by_seed.items()} for run, by_seed in runs.items()}, digits=6)
    return {"runs": runs,
            "across_seeds": {run: {**{n: by_numerics[n]["across_seeds"][run] for n in by_numerics},
                                   "gap": gaps["across_seeds"][run]} for run in runs},
            "vs_first": {run: {n: by_numerics[n]["vs_first"][run] for n in by_numerics} for run in runs}}


def numerics_gap(cfg: ModelConfig, params, valid_tokens: np.ndarray, *, seq_len: int) -> dict[str, dict]:
    """{"float", "fp4": validation bits per byte, "gap": fp4 − float}, each with its interval from resampling the
    windows of `seq_len` tokens (the same draws for all three: the gap is paired window by window)."""
    bits = {numerics: eval_bits(cfg, params, valid_tokens, qat=numerics == "fp4", batch_size=1, seq_len=seq_len)
            for numerics in ("float", "fp4")}
    count = bits["float"][1]
    columns = np.stack([bits["float"][0], bits["fp4"][0], bits["fp4"][0] - bits["float"][0]], axis=1)
    figures = stats.ratio_interval(columns, np.repeat(count[:, None], 3, axis=1))
    return {name: iv.as_dict(digits=6) for name, iv in zip(("float", "fp4", "gap"), figures)}


# The two arms of `qat_vs_float`, as `recipe_ablations.FULL` names them (so both read and record the same runs).
ARMS = {name: recipe_ablations.FULL.arms[name] for name in ("recipe", "float training (no QAT)")}
# CI sizes: recipe_ablations' fast settings (scored after each step while training), in runs and a ledger of their
# own, so the two test files, which pytest may run at once, never train the same run directory.
FAST_SETTINGS = dataclasses.replace(recipe_ablations.FAST, out="runs/qat-vs-float-fast",
                                    ledger="runs/qat-vs-float-fast/ledger.json")


def settings(fast: bool | None = None) -> recipe_ablations.Settings:
    """`FAST_SETTINGS` in fast mode (`CSA2_FAST=1`, `train.longctx.fast_mode`), else `recipe_ablations.FULL`."""
    return FAST_SETTINGS if longctx.fast_mode(fast) else recipe_ablations.FULL


def qat_vs_float(s: recipe_ablations.Settings, *, log: Callable[[str], None] = lambda _: None) -> dict:
    """`recipe_ablations.ablate` of `ARMS` (the long-context recipe with QAT, and in float) on `s`'s base recipe and
    seeds, pass keys scored every `s.curve_every` steps while each run trains; runs and scores come from `s.ledger`
    where it records them."""
    return recipe_ablations.ablate(s.base, ARMS, s.seeds, s.out, curve_every=s.curve_every, ledger=s.ledger, log=log)
