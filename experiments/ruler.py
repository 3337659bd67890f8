"""RULER-style retrieval (Hsieh et al. 2024) as length × depth grids: beyond one pass key, several keys with
distractors, one key holding several values, several keys asked at once, each under the model's own top-k or a
KV-selection policy at the same read budget (SPEC §14; per head for the policies that choose per head, so a layer may
load up to `heads ×` the budget). `paired_by_length` compares two policies on the same prompts.

Tasks (`TASKS`, built by `train.data.ruler_example`; keys of 4 digits):
- "single": one named key, asked for;
- "multikey": 4 keys, one asked; the 3 others are distractors of the same form at random depths;
- "multivalue": one key holding 3 values, all asked (in the order they appear);
- "multiquery": 4 keys, 2 asked at once.
The asked needles sit at the cell's depth. Prompts come in the wording training used ("train") or in a held-out one
that no training row holds (`train.data.TEMPLATES`). Each cell's prompts are read teacher-forced: every answer token
is predicted from the prompt and the answer tokens before it, which is exactly greedy decoding producing the answer
(the forward pass equals prefill + decode), under the SPEC §8 numerics. A policy reads from the first answer step on
(`research.selection.KVSelection`, `start` = the last prompt position); the prompt itself is the prefill and reads
the model's own top-k. Per cell, each with a 95 % interval over its prompts, the independent unit: `exact` the share
of prompts whose whole answer is right (Wilson), `digits` the share of answer digits right (chance 0.1; each
prompt's share, averaged, bootstrap: the digits of one answer are not independent), `bits` the answer digits' bits
(mean over prompts, bootstrap).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import model
from csa2.config import ModelConfig
from csa2.hooks import OWN_TOPK
from experiments.kv_selection import answer_scores
from infer import stats
from research import selection
from train.data import ruler_example


@dataclasses.dataclass(frozen=True)
class Task:
    """`keys` names holding `values` values each, `queries` of them asked (`train.data.ruler_example`)."""

    keys: int = 1
    values: int = 1
    queries: int = 1
    digits: int = 4

    def example(self, rng: np.random.Generator, length: int, depth: float, template: str = "train"):
        return ruler_example(rng, length, depth, keys=self.keys, values=self.values, queries=self.queries,
                             digits=self.digits, template=template)


TASKS = {"single": Task(), "multikey": Task(keys=4), "multivalue": Task(values=3),
         "multiquery": Task(keys=4, queries=2)}


def examples(task: Task, length: int, depth: float, samples: int, *, seed: int = 0,
             template: str = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [samples, length + A − 1], answers [samples, A], digit mask [A]) of one cell in the wording of
    `template` (`train.data.TEMPLATES`): sample k draws from the stream `[seed, length, depth in millionths, k]`
    (the same prompts for every policy and budget); tokens are the prompt and every answer token but the last
    (teacher forcing)."""
    rows = [task.example(np.random.default_rng([seed, length, round(depth * 1e6), k]), length, depth, template)
            for k in range(samples)]
    return (np.stack([np.concatenate([p, a[:-1]]) for p, a, _ in rows]).astype(np.int32),
            np.stack([a for _, a, _ in rows]), rows[0][2])


def answer_logprobs(cfg: ModelConfig, params, tokens: np.ndarray, answer_len: int,
                    policy: selection.Policy | None) -> np.ndarray:
    """Log-probabilities `[B, answer_len, V]` at the answer positions (the last `answer_len`) of `tokens [B, S]`,
    SPEC §8 numerics, reading under `policy` from the first answer step on (None: the model's own top-k)."""
    start = tokens.shape[1] - answer_len
    instrument = OWN_TOPK if policy is None else selection.KVSelection(policy, start)
    logits, _ = model.forward(cfg, params, jnp.asarray(tokens), qat=True, instrument=instrument)
    return np.asarray(jax.nn.log_softmax(logits[:, start:].astype(jnp.float32), axis=-1))


def grid(cfg: ModelConfig, params, task: Task, lengths: Sequence[int], depths: Sequence[float], samples: int, *,
         policy: selection.Policy | None = None, batch: int = 8, seed: int = 0,
         template: str = "train") -> dict[str, dict[str, dict]]:
    """{length: {depth: {"right", "exact", "digits", "digits_by_prompt", "bits"}}} (see the module docstring;
    `right`: how many prompts' answers are right whole; `digits_by_prompt`: each prompt's share of digits right, what
    `by_length` pools), `samples` (≥ 2) prompts per cell in the
    wording of `template` ("held_out": never trained on) read `batch` rows at a time (the last batch padded with
    its first rows, so every batch of a length has one shape)."""
    out = {}
    for length in lengths:
        out[str(length)] = {}
        for depth in depths:
            tokens, answers, mask = examples(task, length, depth, samples, seed=seed, template=template)
            scores = []
            for i in range(0, samples, batch):
                rows = (i + np.arange(batch)) % samples
                lp = answer_logprobs(cfg, params, tokens[rows], answers.shape[1], policy)
                keep = min(batch, samples - i)
                scores.append({k: v[:keep] for k, v in answer_scores(lp, answers[rows], 0, mask).items()})
            per = {k: np.concatenate([s[k] for s in scores]) for k in scores[0]}
            right = int(per["exact"].sum())
            out[str(length)][f"{depth:g}"] = {
                "right": right, "exact": stats.proportion_interval(right, samples).as_dict(),
                "digits": stats.mean_interval(per["digits"]).as_dict(),
                "digits_by_prompt": [round(float(x), 4) for x in per["digits"]],
                "bits": stats.mean_interval(per["bits"]).as_dict()}
    return out


def heatmap(cells: dict[str, dict[str, dict]], measure: str = "exact") -> tuple[list[str], list[str], np.ndarray]:
    """(lengths, depths, values [lengths, depths]) of one measure of a `grid`, for `imshow`."""
    lengths = list(cells)
    depths = list(cells[lengths[0]])
    return lengths, depths, np.array([[cells[n][d][measure]["value"] for d in depths] for n in lengths])


def by_length(cells: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """{length: {"exact", "digits"}} of a `grid` row pooled over its depths, over all their prompts: the answers right
    whole as a share of the prompts (Wilson), the digits right as a mean of the prompts' shares (bootstrap), each as
    `Interval.as_dict()`."""
    out = {}
    for length, row in cells.items():
        right = sum(c["right"] for c in row.values())
        digits = np.concatenate([c["digits_by_prompt"] for c in row.values()])
        out[length] = {"exact": stats.proportion_interval(right, len(digits)).as_dict(),
                       "digits": stats.mean_interval(digits).as_dict()}
    return out


def paired_by_length(cells: dict[str, dict[str, dict]], other: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """{length: the digits right of `cells` minus those of `other` (two `grid`s of one task, seed and wording, so
    the same prompts), prompt by prompt over every depth of the length: the mean difference and its bootstrap
    interval over the prompts, `Interval.as_dict()`}."""
    out = {}
    for length, row in cells.items():
        theirs = other.get(length, {})
        if set(theirs) != set(row) or any(len(theirs[d]["digits_by_prompt"]) != len(c["digits_by_prompt"])
                                          for d, c in row.items()):
            raise ValueError(f"paired_by_length: length {length} has depths {sorted(row)} here and "
                             f"{sorted(theirs)} there, or other prompt counts; pair grids of the same cells")
        diffs = np.concatenate([np.subtract(c["digits_by_prompt"], theirs[d]["digits_by_prompt"])
                                for d, c in row.items()])
        out[length] = stats.mean_interval(diffs).as_dict()
    return out
