"""Scores of finished training runs, kept in the repository under each run's whole recipe.

An experiment such as `experiments.recipe_ablations` trains tens of runs of most of an hour each on a 2-core CPU;
their checkpoints live under `runs/`, which a fresh clone does not have, and no single sitting trains them all.
What the experiment keeps of a finished run is a few scores, so each score is recorded in a ledger: a JSON file
committed beside the notebook, one entry per run, keyed on a hash of the run's recipe (every field of it, and the
fingerprint of the model config it builds). A later session or a clone reads a recorded score instead of training
again; a recipe that differs in any field misses and trains. Each score says which commit of the code measured it
and when, so a figure can be traced to the code that produced it.

A ledger holds what the code measured when it was recorded: a change to how a score is computed (not to the recipe)
does not invalidate it, so such a change must delete the ledger's entries for that part.

Several processes may record into one ledger at once (each trains its own runs): `record` holds a lock beside the
file, reads it again and writes it whole.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import subprocess
from typing import Callable, TypeVar

import filelock
import jax
import numpy as np

from experiments import results

T = TypeVar("T")


def key(recipe: dict) -> str:
    """The ledger key of a run's recipe (a dict of JSON values): the first 16 hex digits of the SHA-256 of its
    canonical JSON."""
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tree_digest(tree) -> str:
    """The first 16 hex digits of the SHA-256 of a pytree's leaves (each one's dtype, shape and bytes, in tree
    order): a recipe field that names the checkpoint a score was measured on, down to the last bit."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        leaf = np.ascontiguousarray(leaf)
        h.update(f"{leaf.dtype}{leaf.shape}".encode())
        h.update(leaf.tobytes())
    return h.hexdigest()[:16]


def load(path: str | pathlib.Path) -> dict:
    """{key: {"recipe", "scores": {part: {"value", "commit", "date"}}}}: the ledger at `path` (empty when there is
    none)."""
    path = pathlib.Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def lookup(path: str | pathlib.Path, recipe: dict, part: str):
    """The value recorded for `part` of the run of `recipe`, or None."""
    entry = load(path).get(key(recipe))
    if entry is None or part not in entry["scores"]:
        return None
    if entry["recipe"] != recipe:  # a 64-bit key collision, or a hand-edited file
        raise ValueError(f"ledger {path}: entry {key(recipe)} holds another recipe; delete that entry")
    return entry["scores"][part]["value"]


def record(path: str | pathlib.Path, recipe: dict, part: str, value) -> None:
    """Record `value` (JSON values) as `part` of the run of `recipe`, with the commit and the date."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    value = json.loads(json.dumps(value, default=results.plain_number, allow_nan=False))
    with filelock.FileLock(path.parent / f".{path.name}.lock"):
        ledger = load(path)
        entry = ledger.setdefault(key(recipe), {"recipe": recipe, "scores": {}})
        entry["scores"][part] = {"value": value, "commit": _commit(), "date": datetime.date.today().isoformat()}
        # Written beside and renamed over: a reader that does not take the lock (`lookup`) never sees half a file.
        part_written = path.with_name(f".{path.name}.partial")
        part_written.write_text(json.dumps(dict(sorted(ledger.items())), indent=1, allow_nan=False) + "\n")
        os.replace(part_written, path)


def cached(path: str | pathlib.Path | None, recipe: dict, part: str, measure: Callable[[], T]) -> T:
    """`part` of the run of `recipe` as the ledger at `path` records it; otherwise `measure()`, recorded. With no
    ledger (`path` None) always `measure()`."""
    if path is None:
        return measure()
    found = lookup(path, recipe, part)
    if found is not None:
        return found
    value = measure()
    record(path, recipe, part, value)
    return lookup(path, recipe, part)  # as JSON gives it back: a later read returns the same thing


def _commit() -> str | None:
    """The commit the code was checked out at (with "+changes" when the tree differs from it), or None outside git."""
    root = results.ROOT
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")
