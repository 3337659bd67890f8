"""The DSpark research checkpoint: a backbone with a drafter adapted on it, built once and cached in `runs/`.

`checkpoint()` returns (config, params with the drafter, report), training only what is not there yet:
the backbone (the `demo` preset with `make demo`'s recipe: `TrainConfig(steps=backbone_steps)`, SPEC §8
numerics) into `OUT/backbone`, then the drafter (`train.dspark.adapt` with the recipe's
`DSparkTrainConfig` and stage count) into `OUT/dspark`. The report (`OUT/report.json`, whose presence
marks the run finished) holds the recipe, the times and the drafter's teacher-forced validation metrics
(`train.dspark.evaluate`); acceptance at inference is measured by `infer.bench_spec` and the DSpark
notebook, not here.

`DEFAULT` is the recipe that measured best in the adaptation grid (docs/results.md, "Adaptation grid"):
the target's own greedy continuations as data (self-distillation). `CSA2_FAST=1` (or `fast=True`) builds
`FAST` into `runs/dspark-fast`: a few steps of each, for CI; that drafter is not expected to accept much.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Callable

from csa2.checkpoints import native as ckpt
from csa2.config import ModelConfig
from csa2.presets import preset
from train import dspark
from train.data import load_corpus
from train.dspark import DSparkTrainConfig
from train.longctx import RECIPE, check_recipe, fast_mode, lock
from train.loop import train
from train.step import TrainConfig

DEFAULT_DIR = "runs/dspark"
FAST_DIR = "runs/dspark-fast"
REPORT = "report.json"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A backbone recipe (preset, steps) and the drafter's (stage count, adaptation config)."""

    preset: str = "demo"
    backbone_steps: int = 240
    stages: int = 1
    dspark: DSparkTrainConfig = DSparkTrainConfig(steps=1800, anchors=16, data="greedy")


DEFAULT = Recipe()
FAST = Recipe(backbone_steps=4, dspark=DSparkTrainConfig(steps=4, data="greedy", distill_rows=16, anchors=4))


def run(recipe: Recipe, out: str | pathlib.Path, *, log: Callable[[str], None] = print) -> tuple[ModelConfig, object,
                                                                                                  dict]:
    """Build `recipe` into `out` (resuming what a stopped run left), evaluate, write report.json."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RECIPE).write_text(json.dumps(dataclasses.asdict(recipe), indent=1) + "\n")
    corpus = load_corpus()
    cfg = preset(recipe.preset)
    t0 = time.perf_counter()
    backbone = out / "backbone"
    state = train(cfg, TrainConfig(steps=recipe.backbone_steps), corpus.train, backbone,
                  resume=ckpt.latest_step(backbone) is not None, log=lambda _: None, save_every=100)
    t1 = time.perf_counter()
    cfg, params = dspark.with_stages(cfg, state.params, recipe.stages, recipe.dspark.seed)
    drafter = out / "dspark"
    params = dspark.adapt(cfg, params, corpus.train, recipe.dspark, drafter, log=lambda _: None,
                          resume=ckpt.latest_step(drafter) is not None, save_every=100)
    t2 = time.perf_counter()
    report = {"recipe": dataclasses.asdict(recipe), "backbone_seconds": round(t1 - t0, 1),
              "drafter_seconds": round(t2 - t1, 1),
              "validation": dspark.evaluate(cfg, params, corpus.valid, recipe.dspark)}
    (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    log(f"# DSpark research checkpoint in {out}: backbone {report['backbone_seconds']:.0f}s, drafter "
        f"{report['drafter_seconds']:.0f}s")
    return cfg, params, report


def checkpoint(path: str | pathlib.Path | None = None, *, fast: bool | None = None, recipe: Recipe | None = None,
               log: Callable[[str], None] = print) -> tuple[ModelConfig, object, dict]:
    """(config, params with the adapted drafter, report) of the DSpark research checkpoint cached in `path`
    (default `runs/dspark`, or `runs/dspark-fast` with `fast`, default CSA2_FAST=1). A finished run is restored;
    otherwise `recipe` (default `DEFAULT` / `FAST`) is built there first. A directory holding another recipe is
    refused (`train.longctx.check_recipe`); concurrent callers take turns on a lock beside it (`train.longctx.lock`)."""
    fast = fast_mode(fast)
    recipe = recipe or (FAST if fast else DEFAULT)
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe: expected a train.dspark_checkpoint.Recipe, got {type(recipe).__name__}")
    out = pathlib.Path(path or (FAST_DIR if fast else DEFAULT_DIR))
    out.parent.mkdir(parents=True, exist_ok=True)
    with lock(out):
        check_recipe(out, recipe)
        if not (out / REPORT).exists():
            return run(recipe, out, log=log)
        cfg, params = ckpt.restore_with_drafter(out / "backbone", out / "dspark")
        return cfg, params, json.loads((out / REPORT).read_text())
