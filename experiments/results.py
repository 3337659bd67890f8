"""A notebook's results as JSON: a full run writes `notebooks/<name>.json` beside the notebook (committed with its
outputs, so the figures can be read and compared without running anything, and the notebook's prose prints its
numbers from it); fast mode (`CSA2_FAST=1`) writes `runs/results-fast/<name>.json` instead, so CI never touches
the committed file.

Every figure with an interval is stored as `infer.stats.Interval.as_dict()`: {"value", "lo", "hi", "n",
"level"}. `check` walks a result and refuses one whose intervals are malformed or that holds none.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
INTERVAL_KEYS = {"value", "lo", "hi", "n", "level"}


def path(name: str, *, fast: bool) -> pathlib.Path:
    """Where the results of notebook `name` go: beside it after a full run, under runs/ in fast mode."""
    return ROOT / ("runs/results-fast" if fast else "notebooks") / f"{name}.json"


def save(name: str, results: dict, *, fast: bool) -> pathlib.Path:
    """Check `results`, write them as the results of notebook `name` (with `"fast": fast`) and return the path.
    NumPy scalars (a measured `np.float32`, a count as `np.int64`) are written as the Python numbers they hold."""
    results = json.loads(json.dumps({"notebook": name, "fast": fast, **results}, default=plain_number))
    check(results)
    out = path(name, fast=fast)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    return out


def plain_number(value):
    """A NumPy scalar as the Python number it holds (for `json.dumps(default=)`); anything else not JSON is refused."""
    if isinstance(value, np.generic) and value.ndim == 0:
        return value.item()
    raise TypeError(f"results: {value!r} ({type(value).__name__}) is not a JSON value; store numbers, strings, "
                    "lists and dicts")


def load(name: str, *, fast: bool) -> dict:
    """The results `save` wrote for notebook `name`."""
    return json.loads(path(name, fast=fast).read_text())


def intervals(results) -> list[tuple[str, dict]]:
    """Every interval in `results` (nested dicts and lists), with its path, e.g. `("ablate/runs/recipe/0/128/keys",
    {...})`."""
    found = []

    def walk(node, where):
        if isinstance(node, dict):
            if node.keys() == INTERVAL_KEYS:
                found.append((where, node))
                return
            for k, v in node.items():
                walk(v, f"{where}/{k}" if where else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")

    walk(results, "")
    return found


def check(results: dict) -> None:
    """ValueError naming the first interval of `results` without finite numbers, `lo ≤ hi`, `n ≥ 1` samples and a
    level in (0, 1) (a percentile bootstrap need not hold its point estimate), or when `results` holds no interval
    at all."""
    found = intervals(results)
    if not found:
        raise ValueError("results: no interval ({value, lo, hi, n, level}) found; every figure a notebook reports "
                         "states its n and interval (infer.stats)")
    for where, iv in found:
        numbers = [iv["value"], iv["lo"], iv["hi"]]
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers):
            raise ValueError(f"results[{where}]={iv}: value, lo and hi must be finite numbers")
        if not iv["lo"] <= iv["hi"]:
            raise ValueError(f"results[{where}]={iv}: needs lo ≤ hi")
        if not (isinstance(iv["n"], int) and iv["n"] >= 1 and 0 < iv["level"] < 1):
            raise ValueError(f"results[{where}]={iv}: needs an integer n ≥ 1 and a level in (0, 1)")
