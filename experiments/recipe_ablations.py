"""Why the long-context recipe is what it is (`train.longctx`): its choices measured as ablations with seeds and
intervals. `python -m experiments.recipe_ablations [--fast]` trains and scores all of it (`run`; runs cached under
`runs/recipe-ablations`, resumable) and writes the results JSON (`experiments.results`).

The whole of it is about 20 runs of most of an hour each on a 2-core CPU, more than one sitting, so every score is
recorded as it is measured in a ledger committed beside the notebook (`notebooks/recipe_ablations.runs.json`,
`experiments.ledger`, keyed on each run's whole recipe) and read from there by later runs and by clones.
`--part`, `--arm` and `--seed` record a slice only (`record`), e.g. two processes each training one arm, and print
what is still to train (`missing`).

- `init_scale`: the control task `HiddenDigit` (one digit hidden among random letters, asked for at the end),
  trained from several initializer scales on the same seeds. The released `initializer_range` 0.02 is sized for
  d = 5120; at the `demo` preset's d = 64 a query or an attention output passes two projections of gain ≈ 0.16.
- `ablate`: arms of `LongCtxRecipe` overrides (induction rows off, the indexer KL dense at every step, a smaller
  read budget, float training without QAT, …), each arm trained on every seed (`longctx.fit` into
  `OUT/<arm>/seed<k>`, keyed on the whole recipe, resumable) and scored by pass keys at the recipe's lengths
  (SPEC §8 numerics, as served), also every `curve_every` steps while it trains (when retrieval emerges).
- `read_budget`: trained checkpoints scored at other inference read budgets (top-k and candidate blocks: no
  weight depends on them), the same prompts at every budget.

Statistics. Within a run, keys and digits are shares of independent prompts (Wilson intervals; the digits of one
key are correlated, so their interval is narrower than their evidence) and answer bits a mean over prompts
(bootstrap). Across seeds, the per-seed values get Student's t interval (`infer.stats.seed_interval`: with 3 seeds
t = 4.30, wide by design). Arms are compared per seed (a seed fixes the initialization key and the data stream),
the differences again by t; budgets per prompt (the same prompts), by bootstrap over prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import re
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import compile_cache, model
from csa2.checkpoints import native
from csa2.config import ModelConfig
from csa2.presets import BOS_ID, preset
from csa2.tokenizer import encode
from experiments import ledger as ledger_lib, results
from infer import stats
from infer.schedule import config_fingerprint
from train import longctx
from train.longctx import LongCtxRecipe
from train.loop import train
from train.step import TrainConfig

_LETTERS = encode("abcdefghijklmnopqrstuvwxyz", bos=False)
_DIGITS = encode("0123456789", bos=False)
_QUERY = int(encode("?", bos=False)[0])
_EVAL_STREAM = 1  # eval rows draw from rng streams [_EVAL_STREAM, k]; training from [seed, step]


# ---------------------------------------------------------------------------------------------
# Init scale: the hidden-digit control task

@dataclasses.dataclass(frozen=True)
class HiddenDigit:
    """Rows of `length` tokens: BOS, `length − 2` random letters one of which is a random digit, then "?"; the
    only target that counts is the next token, the digit. Its distance from the "?" is uniform in [1, length − 2],
    so most digits lie beyond the `demo` preset's 32-token window and only the Global KV and top-k reach them.
    Trained in float for `steps` of `batch_size` rows; scored on `eval_rows` held-out rows."""

    preset: str = "demo"
    length: int = 64
    steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 20
    eval_rows: int = 512

    def __post_init__(self) -> None:
        for name in ("length", "steps", "batch_size", "eval_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"HiddenDigit.{name}={getattr(self, name)!r}: must be an integer ≥ 1")
        if self.length < 3:
            raise ValueError(f"HiddenDigit.length={self.length}: a row needs BOS, a digit and the '?': use ≥ 3")

    def train_config(self, seed: int) -> TrainConfig:
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, seq_len=self.length, lr=self.lr,
                           warmup=self.warmup, qat_from=None, seed=seed)


def hidden_digit_rows(rng: np.random.Generator, rows: int, length: int) -> tuple[np.ndarray, ...]:
    """(inputs, targets, weights) `[rows, length]` and the digit's distance from the query `[rows]`: see
    `HiddenDigit`; weights are 1 at the last position (the digit) and 0 elsewhere."""
    body = rng.choice(_LETTERS, (rows, length - 2))
    where = rng.integers(0, length - 2, rows)
    digit = rng.choice(_DIGITS, rows)
    body[np.arange(rows), where] = digit
    seq = np.concatenate([np.full((rows, 1), BOS_ID), body, np.full((rows, 1), _QUERY), digit[:, None]], axis=1)
    weights = np.zeros((rows, length), np.float32)
    weights[:, -1] = 1.0
    return (seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32), weights,
            (length - 2 - where).astype(np.int64))  # the query sits at position length − 1, the digit at where + 1


@functools.partial(jax.jit, static_argnames="cfg")
def _last_argmax(cfg: ModelConfig, params, tokens: jax.Array) -> jax.Array:
    logits, _ = model.forward(cfg, params, tokens, qat=False)
    return jnp.argmax(logits[:, -1], axis=-1)


def hidden_digit_score(cfg: ModelConfig, params, spec: HiddenDigit, *, batch: int = 64) -> dict:
    """{"all", "near", "far"}: the share of the held-out rows (the same for every run) whose digit is the argmax
    at the query, with its Wilson interval; "far" are the digits beyond the sliding window (distance ≥ W)."""
    inputs, targets, _, distance = hidden_digit_rows(np.random.default_rng([_EVAL_STREAM, spec.length]),
                                                     spec.eval_rows, spec.length)
    right = np.concatenate([np.asarray(_last_argmax(cfg, params, jnp.asarray(inputs[i:i + batch])))
                            for i in range(0, len(inputs), batch)]) == targets[:, -1]
    far = distance >= cfg.sliding_window
    return {name: stats.proportion_interval(int(right[keep].sum()), int(keep.sum())).as_dict()
            for name, keep in (("all", np.ones_like(far)), ("near", ~far), ("far", far)) if keep.any()}


def init_scale(spec: HiddenDigit, stds: Sequence[float], seeds: Sequence[int], out: str | pathlib.Path, *,
               ledger: str | pathlib.Path | None = None, log: Callable[[str], None] = lambda _: None) -> dict:
    """{"runs": {std: {seed: score}}, "across_seeds": {std: t interval of "all" over the seeds}, "vs_first": {std:
    t interval of the per-seed difference to the first std}} (`hidden_digit_score`; keys are strings, as in JSON;
    with one seed the across-seed entries are None). A score the `ledger` records is read from it; otherwise its run
    trains into `out/std<std>/seed<k>` (a finished run is reused, a partial one resumed, a directory of another
    recipe refused) and the score is recorded."""
    runs = {}
    for std in stds:
        cfg = preset(spec.preset).replace(initializer_range=std)
        runs[f"{std:g}"] = {}
        for seed in seeds:
            path = pathlib.Path(out) / f"std{std:g}" / f"seed{seed}"
            recipe = _hidden_digit_recipe(spec, std, seed)

            def measure():
                with longctx.lock(path):
                    longctx.claim(path, recipe)
                    state = train(cfg, spec.train_config(seed), _hidden_digit_batches(spec, seed), path,
                                  resume=native.latest_step(path) is not None, log=log, bar=False)
                return hidden_digit_score(cfg, state.params, spec)

            runs[f"{std:g}"][str(seed)] = score = ledger_lib.cached(ledger, recipe, "hidden_digit", measure)
            log(f"std {std:g} seed {seed}: {score['all']}")
    return {"runs": runs, **across_seeds({std: {s: r["all"]["value"] for s, r in by_seed.items()}
                                          for std, by_seed in runs.items()})}


def _hidden_digit_recipe(spec: HiddenDigit, std: float, seed: int) -> dict:
    """Everything a hidden-digit run depends on: its run directory's recipe and its ledger key."""
    cfg = preset(spec.preset).replace(initializer_range=std)
    return {"task": "hidden_digit", "config": config_fingerprint(cfg), **dataclasses.asdict(spec), "seed": seed}


def _hidden_digit_batches(spec: HiddenDigit, seed: int):
    def from_step(start: int):
        step = start
        while True:
            yield hidden_digit_rows(np.random.default_rng([seed, step]), spec.batch_size, spec.length)[:3]
            step += 1

    return from_step


# ---------------------------------------------------------------------------------------------
# Recipe ablations: arms of LongCtxRecipe overrides × seeds

def slug(arm: str) -> str:
    """An arm's name as a directory name."""
    return re.sub(r"[^a-z0-9]+", "-", arm.lower()).strip("-") or "arm"


def passkey_scores(cfg: ModelConfig, params, recipe: LongCtxRecipe) -> dict[str, dict]:
    """{length: `read_scores`} of the pass keys at `recipe.eval_lengths` (`longctx.passkey_reads`, SPEC §8
    numerics)."""
    return {str(n): read_scores(*longctx.passkey_reads(cfg, params, recipe, n)) for n in recipe.eval_lengths}


def read_scores(hit: np.ndarray, logp: np.ndarray) -> dict[str, dict]:
    """`longctx.read_figures` ("keys", "digits": shares with Wilson intervals) and "bits": answer bits per digit,
    mean over keys with a bootstrap interval, of one length's reads (`hit`, `logp` `[samples, depths, digits]`)."""
    return {**longctx.read_figures(hit),
            "bits": stats.mean_interval((-logp.mean(axis=2) / np.log(2)).ravel()).as_dict()}


def ablate(base: LongCtxRecipe, arms: Mapping[str, Mapping], seeds: Sequence[int], out: str | pathlib.Path, *,
           curve_every: int = 0, ledger: str | pathlib.Path | None = None,
           log: Callable[[str], None] = lambda _: None) -> dict:
    """Every arm (name → `LongCtxRecipe` field overrides on `base`) trained on every seed and scored by
    `passkey_scores`: {"runs": {arm: {seed: scores}}, "across_seeds": {arm: {length: {measure: t interval}}},
    "vs_first": {arm: {length: {measure: t interval of the per-seed difference to the first arm}}}}; with one seed
    the across-seed entries are None. Run directories: `out/<slug(arm)>/seed<k>`, keyed on the whole recipe.

    `curve_every` > 0 also scores every run at each multiple of that many steps while it trains (when retrieval
    emerges), kept in the run's `curve.json` and returned as {"curves": {arm: {seed: {step: scores}}}}; a step
    already trained past when the curve is first asked for has no score. Scores and curves the `ledger` records
    are read from it; what it lacks is measured (training the run) and recorded."""
    runs, curves = {}, {}
    for arm, overrides in arms.items():
        runs[arm], curves[arm] = {}, {}
        for seed in seeds:
            recipe = dataclasses.replace(base, **overrides, seed=seed)
            key = run_recipe(recipe)
            if curve_every:
                curves[arm][str(seed)] = ledger_lib.cached(ledger, key, _curve_part(curve_every),
                                                           lambda: _curve(recipe, out, arm, curve_every, log))
            runs[arm][str(seed)] = scores = ledger_lib.cached(
                ledger, key, "passkey", lambda: passkey_scores(*_fitted(recipe, out, arm, log), recipe))
            log(f"{arm} seed {seed}: " + ", ".join(f"{n} tokens digits {s['digits']['value']:.2f}"
                                                    for n, s in scores.items()))
    per_measure = {}
    for length in map(str, base.eval_lengths):
        for measure in ("keys", "digits", "bits"):
            per_measure[length, measure] = across_seeds(
                {arm: {s: r[length][measure]["value"] for s, r in by_seed.items()} for arm, by_seed in runs.items()})
    return {"runs": runs, **{part: {arm: {length: {measure: per_measure[length, measure][part][arm]
                                                   for measure in ("keys", "digits", "bits")}
                                          for length in map(str, base.eval_lengths)} for arm in arms}
                             for part in ("across_seeds", "vs_first")},
            **({"curves": curves} if curve_every else {})}


def run_recipe(recipe: LongCtxRecipe) -> dict:
    """A long-context run's ledger recipe: every field of `recipe` and the fingerprint of the model config it builds
    (a preset whose definition changed under the same name is another run)."""
    return {"recipe": longctx.as_json(recipe), "config": config_fingerprint(recipe.config())}


def _curve(recipe: LongCtxRecipe, out: str | pathlib.Path, arm: str, every: int, log) -> dict[str, dict]:
    """{step: `passkey_scores`} at each multiple of `every` below the recipe's end, training the run up to each
    in turn; scores are kept in the run's curve.json, so a resumed or repeated call scores each step once."""
    path = _run_dir(out, arm, recipe.seed)
    store = path / "curve.json"
    curve = json.loads(store.read_text()) if store.exists() else {}
    for step in range(every, recipe.steps, every):
        trained = native.latest_step(path)
        if str(step) in curve or (trained is not None and trained > step):
            continue
        curve[str(step)] = passkey_scores(*_fitted(recipe, out, arm, log, until=step), recipe)
        store.write_text(json.dumps(curve, indent=1) + "\n")
    return curve


def across_seeds(values: Mapping[str, Mapping[str, float]], *, digits: int = 3) -> dict:
    """{"across_seeds": {arm: t interval over its seeds}, "vs_first": {arm: t interval of its per-seed difference
    to the first arm (the seeds both ran)}}, rounded to `digits` decimals; None where fewer than 2 seeds."""
    first = next(iter(values.values()))

    def interval(v):
        return stats.seed_interval(v).as_dict(digits) if len(v) >= 2 else None

    return {"across_seeds": {arm: interval(list(v.values())) for arm, v in values.items()},
            "vs_first": {arm: interval([v[s] - first[s] for s in v if s in first]) for arm, v in values.items()}}


# ---------------------------------------------------------------------------------------------
# Read budget at inference

def read_budget(cfg: ModelConfig, params, recipe: LongCtxRecipe, budgets: Mapping[str, tuple[int, int]]) -> dict:
    """{budget: {length: `read_scores` and "vs_first": the per-key difference in digits right to the first budget,
    bootstrap over keys}}: one checkpoint's pass keys read at each `(index_topk, candidate_topk_blocks)` of
    `budgets`, the same prompts at every budget (None for the first)."""
    out, first, reference = {}, {}, next(iter(budgets))
    for name, (topk, blocks) in budgets.items():
        at = cfg.replace(index_topk=topk, candidate_topk_blocks=blocks)
        out[name] = {}
        for length in map(str, recipe.eval_lengths):
            hit, logp = longctx.passkey_reads(at, params, recipe, int(length))
            per_key = hit.mean(axis=2).ravel()  # digits right per key
            base = first.setdefault(length, per_key)
            out[name][length] = {**read_scores(hit, logp), "vs_first": None if name == reference
                                 else stats.mean_interval(per_key - base).as_dict()}
    return out


def budget_sweep(base: LongCtxRecipe, arms: Mapping[str, Mapping], arm: str, seeds: Sequence[int],
                 out: str | pathlib.Path, budgets: Mapping[str, tuple[int, int]], *,
                 ledger: str | pathlib.Path | None = None, log: Callable[[str], None] = lambda _: None) -> dict:
    """`read_budget` on each seed's checkpoint of the `ablate` arm `arms[arm]` (the runs `ablate` trains into `out`;
    trained here when missing): {"runs": {seed: read_budget}, "across_seeds": {budget: {length: t interval of
    digits right over the seeds}}, "vs_first": {budget: {length: t interval of the per-seed difference to the first
    budget}}}. Sweeps the `ledger` records (under the run and the budgets) are read from it."""
    runs = {}
    for seed in seeds:
        recipe = dataclasses.replace(base, **arms[arm], seed=seed)
        runs[str(seed)] = ledger_lib.cached(ledger, run_recipe(recipe), _budget_part(budgets),
                                            lambda: read_budget(*_fitted(recipe, out, arm, log), recipe, budgets))
    per_length = {n: across_seeds({b: {s: r[b][n]["digits"]["value"] for s, r in runs.items()} for b in budgets})
                  for n in map(str, base.eval_lengths)}
    return {"runs": runs, **{part: {b: {n: per_length[n][part][b] for n in per_length} for b in budgets}
                             for part in ("across_seeds", "vs_first")}}


def _curve_part(every: int) -> str:
    return f"curve every {every}"


def _budget_part(budgets: Mapping[str, tuple[int, int]]) -> str:
    return "read budgets " + json.dumps({name: list(b) for name, b in budgets.items()})


def _run_dir(out: str | pathlib.Path, arm: str, seed: int) -> pathlib.Path:
    return pathlib.Path(out) / slug(arm) / f"seed{seed}"


def _fitted(recipe: LongCtxRecipe, out: str | pathlib.Path, arm: str, log,
            until: int | None = None) -> tuple[ModelConfig, object]:
    """(config, params) of `recipe` trained (or restored) in `out/<slug(arm)>/seed<k>` up to step `until` (default:
    the end), the directory keyed on the whole recipe."""
    path = _run_dir(out, arm, recipe.seed)
    with longctx.lock(path):
        longctx.claim(path, recipe)
        cfg, state = longctx.fit(recipe, path, log=log, until=until)
    return cfg, state.params


# ---------------------------------------------------------------------------------------------
# The notebook's settings and the whole run

@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything `run` trains and scores: the init-scale control (`task` from each of `stds`), the recipe arms
    (`arms` on `base`, each also scored every `curve_every` steps while it trains; 0: at the end only), the
    inference budgets read by the checkpoints of `arms[budget_arm]`, on every seed of `seeds`, with runs under
    `out` and their scores recorded in `ledger` (`experiments.ledger`; None: none)."""

    task: HiddenDigit
    stds: tuple[float, ...]
    base: LongCtxRecipe
    arms: Mapping[str, Mapping]
    budget_arm: str
    budgets: Mapping[str, tuple[int, int]]
    seeds: tuple[int, ...]
    out: str
    ledger: str | None = None
    curve_every: int = 0

    def __post_init__(self) -> None:
        if self.budget_arm not in self.arms:
            raise ValueError(f"Settings.budget_arm={self.budget_arm!r}: name one of the arms {list(self.arms)}")
        if len(self.seeds) < 2:
            raise ValueError(f"Settings.seeds={self.seeds}: intervals over seeds need at least 2 seeds")
        if self.curve_every < 0:
            raise ValueError(f"Settings.curve_every={self.curve_every}: score every that many training steps (> 0) "
                             "or only at the end (0)")


FULL = Settings(
    task=HiddenDigit(),
    stds=(0.02, 0.05, 0.1),
    # 600 steps of 16 × 128-token rows, the side runs' size (at 400 × 8 every arm read pass-key digits at chance,
    # 0.08–0.14 on 3 seeds: too short to tell the choices apart). About 45 min a run on a busy 2-core CPU.
    base=LongCtxRecipe(stages=((600, 16, 128),), eval_lengths=(128, 256, 512), eval_samples=8),
    arms={"recipe": {}, "no induction rows": {"repeat_share": 0.0},
          "dense indexer KL at every step": {"dense_warmup_steps": 600},
          "top-k 32, 8 blocks": {"index_topk": 32, "candidate_topk_blocks": 8},
          "float training (no QAT)": {"qat": False}},
    budget_arm="top-k 32, 8 blocks",
    budgets={"top-k 32, 8 blocks": (32, 8), "64, 16": (64, 16), "128, 32": (128, 32), "256, 64": (256, 64)},
    seeds=(0, 1, 2),
    out="runs/recipe-ablations",
    ledger="notebooks/recipe_ablations.runs.json",  # committed: a clone reads the runs instead of training them
    curve_every=150)

# CI sizes (`--fast`, CSA2_FAST=1; tests/experiments/test_recipe_ablations.py): the arms share one model
# config and the recipe's training shapes are train.longctx.FAST's, so within one test run they load the programs
# compiled before them (tests/conftest.py's compilation cache).
FAST = Settings(
    task=HiddenDigit(length=48, steps=2, batch_size=2, warmup=1, eval_rows=32),
    stds=(0.02, 0.1),
    base=dataclasses.replace(longctx.FAST, stages=((2, 4, 128),), eval_depths=(0.5,), eval_samples=3),
    arms={"recipe": {}, "no induction rows": {"repeat_share": 0.0}},
    budget_arm="recipe",
    budgets={"as trained": (128, 32), "top-k 32, 8 blocks": (32, 8)},
    seeds=(0, 1),
    out="runs/recipe-ablations-fast",
    ledger="runs/recipe-ablations-fast/ledger.json",
    curve_every=1)


def settings(fast: bool | None = None) -> Settings:
    """`FAST` in fast mode (`CSA2_FAST=1`, `train.longctx.fast_mode`), else `FULL`."""
    return FAST if longctx.fast_mode(fast) else FULL


def run(s: Settings, *, log: Callable[[str], None] = lambda _: None) -> dict:
    """{"init_scale", "ablate", "read_budget"}: the three experiments of `s` (runs trained into `s.out`, or
    restored from it)."""
    return {"init_scale": init_scale(s.task, s.stds, s.seeds, pathlib.Path(s.out) / "init-scale", ledger=s.ledger,
                                     log=log),
            "ablate": ablate(s.base, s.arms, s.seeds, s.out, curve_every=s.curve_every, ledger=s.ledger, log=log),
            "read_budget": budget_sweep(s.base, s.arms, s.budget_arm, s.seeds, s.out, s.budgets, ledger=s.ledger,
                                        log=log)}


PARTS = ("init_scale", "ablate", "read_budget")


def record(s: Settings, *, parts: Sequence[str] = PARTS, arms: Sequence[str] | None = None,
           seeds: Sequence[int] | None = None, log: Callable[[str], None] = lambda _: None) -> None:
    """Train and score part of `s` into its ledger: the experiments `parts`, the ablation arms `arms` (and the read
    budgets when the budget arm is among them), the seeds `seeds` (None: all of each). Several processes may each
    record a part at once; `run` then reads everything from the ledger."""
    _check_ledger(s)
    for name, given, known in (("parts", parts, PARTS), ("arms", arms or (), tuple(s.arms)),
                               ("seeds", seeds or (), s.seeds)):
        if unknown := [x for x in given if x not in known]:
            raise ValueError(f"{name}={list(given)}: {unknown} not among {list(known)}; name some of those")
    arms, seeds = list(s.arms) if arms is None else list(arms), s.seeds if seeds is None else tuple(seeds)
    if "init_scale" in parts:
        init_scale(s.task, s.stds, seeds, pathlib.Path(s.out) / "init-scale", ledger=s.ledger, log=log)
    if "ablate" in parts:
        ablate(s.base, {arm: s.arms[arm] for arm in arms}, seeds, s.out, curve_every=s.curve_every, ledger=s.ledger,
               log=log)
    if "read_budget" in parts and s.budget_arm in arms:
        budget_sweep(s.base, s.arms, s.budget_arm, seeds, s.out, s.budgets, ledger=s.ledger, log=log)


def missing(s: Settings) -> list[str]:
    """What `s.ledger` does not record yet, one line per run (with the parts it lacks): what is left to train."""
    _check_ledger(s)
    left = [f"init_scale std {std:g} seed {seed}" for std in s.stds for seed in s.seeds
            if ledger_lib.lookup(s.ledger, _hidden_digit_recipe(s.task, std, seed), "hidden_digit") is None]
    for arm, overrides in s.arms.items():
        for seed in s.seeds:
            parts = (["passkey"] + [_curve_part(s.curve_every)] * bool(s.curve_every)
                     + [_budget_part(s.budgets)] * (arm == s.budget_arm))
            key = run_recipe(dataclasses.replace(s.base, **overrides, seed=seed))
            if lacking := [p for p in parts if ledger_lib.lookup(s.ledger, key, p) is None]:
                left.append(f"ablate arm {arm!r} seed {seed}: {', '.join(lacking)}")
    return left


def _check_ledger(s: Settings) -> None:
    if s.ledger is None:
        raise ValueError("Settings.ledger=None: `record` and `missing` work on a ledger; give Settings a ledger path")


def claims(res: dict) -> list[str]:
    """The comparisons `run`'s results support, as sentences: every arm, std and budget against the first one, with
    the interval of its per-seed difference and whether that interval excludes 0 (the prose of the notebook, so no
    number in it can go stale)."""
    init = res["init_scale"]["vs_first"]
    first = next(iter(init))
    out = [_claim(f"init std {std} vs {first}", "hidden digits right", iv) for std, iv in init.items() if std != first]
    for name in ("ablate", "read_budget"):
        part = res[name]["vs_first"]
        first = next(iter(part))
        for other, by_length in part.items():
            for length, iv in by_length.items() if other != first else ():
                out.append(_claim(f"{other} vs {first}, {length} tokens", "digits right",
                                  iv["digits"] if name == "ablate" else iv))
    return out


def _claim(label: str, what: str, iv: dict | None) -> str:
    if iv is None:
        return f"{label}: one seed, no interval"
    verdict = ("the interval excludes 0" if iv["lo"] > 0 or iv["hi"] < 0
               else "the interval holds 0: no difference shown")
    return (f"{label}: {what} {stats.interval_text(iv, '+.2f')} "
            f"(95 %, n = {iv['n']} seeds): {verdict}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.recipe_ablations", description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", action="store_true", help="CI sizes (as CSA2_FAST=1)")
    p.add_argument("--part", action="append", choices=PARTS,
                   help="record only this experiment into the ledger (repeat for several); no results file")
    p.add_argument("--arm", action="append", help="record only this ablation arm (repeat for several)")
    p.add_argument("--seed", action="append", type=int, help="record only this seed (repeat for several)")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.enable_cli(p, args.compile_cache)
    fast = longctx.fast_mode(args.fast or None)
    s, log = settings(fast), lambda line: print(line, flush=True)
    if args.part or args.arm or args.seed:
        try:
            record(s, parts=args.part or PARTS, arms=args.arm, seeds=args.seed, log=log)
        except ValueError as e:
            p.error(str(e))
        left = missing(s)
        print(f"recorded in {s.ledger}; still to train: " + ("; ".join(left) if left else "nothing"))
        return 0
    print(f"results: {results.save('recipe_ablations', run(s, log=log), fast=fast)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
