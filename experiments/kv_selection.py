"""KV-selection baselines at an equal read budget (SPEC §14): what each policy reads, keeps and loses for ever,
and what that costs in retrieval and in bits per byte.

Every policy of `research.selection` runs inside the model (`forward(..., instrument=)`, SPEC §8
numerics, probes on): the positions before `start` are the prefill and read the model's own top-k, the ones
from `start` on read what the policy chooses, `index_topk` Global entries per step (the budget; PyramidKV: on
average over layers), next to the sliding window every policy keeps. "csa2" is the model's own indexer. H2O,
SnapKV, PyramidKV and Quest choose for each attention head on its own, as their papers do: each head reads the
budget, and since the heads share one Global KV (SPEC §3), a layer loads, and an evicting policy must keep, the
union of its heads' sets. `pooled()` gives the same four choosing one set from their heads' pooled scores, as
csa2's indexer does.

Measures, over the Global-reading layers and the queries from `start` on that see more entries than the budget
(`budget_use`): `reads` entries read per step (per head), `distinct` the distinct entries read per step (all
heads together), `kept` the share of visible entries still held (the distinct ones read; 1 for the policies
that evict nothing), `recall` the share of the layer's dense Global attention mass it read (as in
`experiments.topk`; per head, each head's mass on its own set, averaged), `lost` the mass on entries already
evicted for ever. Quality (`retrieval`, `bits`): pass
keys and multi-needle keys read teacher-forced with every answer digit predicted under the policy (`start` = the
last prompt position), by needle depth: whether the answer steps read the needle's Global entries at all
(`needle_reads`), the digits right and the answer's bits; bits per byte of held-out text scored from its
middle on.

Each quality figure comes with its n and a 95 % interval over prompts, the independent unit (the digits of one
key are not: `infer.stats.prompt_intervals`): keys retrieved whole as a share of independent trials (Wilson), the other
means by a bootstrap over prompts (`infer.stats`). Two policies run on the same prompts, so `paired` compares them
prompt by prompt: the mean difference and its bootstrap interval, tighter than two intervals side by side.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import time
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import model
from csa2.config import ModelConfig
from csa2.hooks import Joined
from csa2.indexer import visible_entries
from csa2.layout import layer_plan
from experiments import ledger as ledger_lib, topk
from infer import stats
from infer.schedule import config_fingerprint
from research import selection
from research.probe_stats import ProbeStats, Summary
from train.data import multi_needle_example, passkey_example

NAMES = ("csa2", "oracle", "streamingllm", "h2o", "snapkv", "pyramidkv", "quest")


def policies() -> dict[str, selection.Policy | None]:
    """Every baseline at its default settings, by name ("csa2": None, the model's own top-k)."""
    found = {"csa2": None, "oracle": selection.Oracle(), "streamingllm": selection.StreamingLLM(),
             "h2o": selection.H2O(), "snapkv": selection.SnapKV(), "pyramidkv": selection.PyramidKV(),
             "quest": selection.Quest()}
    assert tuple(found) == NAMES
    return found


POOLED = ("h2o", "snapkv", "pyramidkv", "quest")  # the policies that choose per head unless asked to pool


def pooled() -> dict[str, selection.Policy]:
    """The policies of `POOLED` choosing one set for all the heads of a layer (`per_head=False`), as csa2's
    indexer does, named "<name> pooled"."""
    found = policies()
    return {f"{name} pooled": dataclasses.replace(found[name], per_head=False) for name in POOLED}


def run(cfg: ModelConfig, params, tokens, policy: selection.Policy | None, start) -> tuple[np.ndarray, Summary]:
    """Log-probabilities `[B, S, V]` and every layer's probe statistics `[L, B, S, ·]` (`research.probe_stats`)
    of `tokens [B, S]` under `policy` from position `start` (an int or one per row) on, as host arrays."""
    instrument = ProbeStats() if policy is None else Joined(selection.KVSelection(policy, start), ProbeStats())
    logits, aux = model.forward(cfg, params, jnp.asarray(tokens, jnp.int32), qat=True, instrument=instrument)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1)), jax.tree.map(np.asarray, aux["tap"])


def budget_use(cfg: ModelConfig, rec: Summary, policy: selection.Policy | None, start) -> dict[str, np.ndarray]:
    """{reads, distinct, kept, recall, lost}, per row `[B]` the mean over the Global-reading layers and the row's
    queries at positions ≥ `start` that see more entries than `index_topk` (see the module docstring; NaN for a row
    without such a query)."""
    evicts = policy is not None and policy.evicts
    sums = {k: 0.0 for k in USE}
    count = 0
    for spec in layer_plan(cfg):
        if spec.role == "swa":
            continue
        ids = rec.topk[spec.index]  # [B, S, K], or per head [B, S, H, K]
        s = ids.shape[1]
        visible = np.asarray(visible_entries(np.arange(s), spec.ratio))  # [S]
        where = topk.counted(cfg, spec.index, rec) & (np.arange(s) >= np.reshape(start, (-1, 1)))
        reads = np.sum(ids >= 0, axis=-1)
        reads = np.mean(reads, axis=-1) if ids.ndim == 4 else reads
        distinct = distinct_reads(ids)
        recall = topk.share(rec.read[spec.index], rec.total[spec.index])
        values = {"reads": reads, "distinct": distinct,
                  "kept": distinct / np.maximum(visible, 1) if evicts else np.ones_like(reads, float),
                  "recall": recall, "lost": 1.0 - recall if evicts else np.zeros_like(recall)}
        for k, v in values.items():
            sums[k] = sums[k] + np.sum(np.where(where, v, 0.0), axis=1)
        count = count + np.sum(where, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {k: v / count for k, v in sums.items()}


def distinct_reads(ids: np.ndarray) -> np.ndarray:
    """How many distinct entries each query reads `[B, S]`: of `ids [B, S, K]`, or of every head's `[B, S, H, K]`
    together (what the heads of a layer load from the shared Global KV, and what an evicting policy must keep)."""
    flat = np.sort(ids.reshape(ids.shape[:2] + (-1,)), axis=-1)
    first = np.concatenate([np.ones(flat.shape[:2] + (1,), bool), flat[..., 1:] != flat[..., :-1]], axis=-1)
    return np.sum(first & (flat >= 0), axis=-1)


def retrieval_examples(length: int, depths, samples: int, *, keys: int = 1, digits: int = 5, seed: int = 0,
                       template: str = "held_out") -> list[tuple[np.ndarray, np.ndarray]]:
    """`samples` batches of (tokens [len(depths), length + digits − 1], answers [len(depths), digits]): one
    pass key (`keys` = 1) or `keys` named keys (one queried, all at the row's depth) per row, row i at
    `depths[i]`, in the wording of `template` (`train.data.TEMPLATES`; default the one no training row holds);
    tokens are the prompt and every answer digit but the last (teacher forcing)."""
    out = []
    for sample in range(samples):
        rng = np.random.default_rng([seed, length, keys, sample])
        pairs = [passkey_example(rng, length, d, digits=digits, template=template) if keys == 1
                 else multi_needle_example(rng, length, keys, [d] * keys, digits=digits, template=template)
                 for d in depths]
        out.append((np.stack([np.concatenate([p, a[:-1]]) for p, a in pairs]), np.stack([a for _, a in pairs])))
    return out


def needle_span(prompt: np.ndarray, answer: np.ndarray) -> tuple[int, int]:
    """Token positions `[lo, hi)` of the answer's digits inside `prompt` (the needle that holds the key)."""
    n = len(answer)
    hits = [i for i in range(len(prompt) - n + 1) if np.array_equal(prompt[i:i + n], answer)]
    if not hits:
        raise ValueError(f"needle_span: the answer {answer.tolist()} does not occur in the prompt")
    return hits[0], hits[0] + n


def needle_reads(cfg: ModelConfig, rec: Summary, spans, start: int, n: int) -> np.ndarray:
    """Per row: the share of (Global-reading layer, answer query at positions `start … start + n − 1`) pairs
    whose read set holds an entry of the needle (`spans [B]` token ranges; entry i covers tokens
    `[i·ratio, (i + 1)·ratio)`, SPEC §4). Retrieval through the Global KV needs this; an evicting policy that
    dropped the needle reads 0."""
    hits = []
    for spec in layer_plan(cfg):
        if spec.role == "swa":
            continue
        ids = rec.topk[spec.index][:, start:start + n]  # [B, n, K], or per head [B, n, H, K]
        ids = ids.reshape(ids.shape[:2] + (-1,))  # a needle entry read by any head
        lo = np.array([a for a, _ in spans]) // spec.ratio
        hi = (np.array([b for _, b in spans]) - 1) // spec.ratio
        inside = (ids >= lo[:, None, None]) & (ids <= hi[:, None, None])
        hits.append(np.any(inside, axis=-1))  # [B, n]
    return np.mean(np.stack(hits), axis=(0, 2))


def answer_scores(logprobs: np.ndarray, answers: np.ndarray, start: int, mask: np.ndarray | None = None
                  ) -> dict[str, np.ndarray]:
    """Per row: `exact` (every answer token is the argmax = greedy decoding retrieves the answer), `digits` (share of
    the retrieved tokens right, chance 0.1) and `bits` (their −log2 p, per token), the answer tokens predicted at
    positions `start …` of `logprobs [B, S, V]`; `mask [n]` marks the retrieved tokens among the answer's
    (default: all; e.g. the digits of a list, not its separators)."""
    n = answers.shape[1]
    mask = np.ones(n, bool) if mask is None else np.asarray(mask, bool)
    lp = logprobs[:, start:start + n]  # [B, n, V]
    hit = np.argmax(lp, axis=-1) == answers
    bits = -np.take_along_axis(lp, answers[..., None], axis=-1)[..., 0] / np.log(2)
    return {"exact": np.all(hit, axis=1).astype(float), "digits": np.mean(hit[:, mask], axis=1),
            "bits": np.mean(bits[:, mask], axis=1)}


def bits_per_byte(logprobs: np.ndarray, targets: np.ndarray, start: int) -> np.ndarray:
    """Bits per byte (the byte tokenizer: one token per byte) of each row of `targets [B, S]` at positions ≥ `start`
    `[B]` (rows of one length: their mean is the pooled figure)."""
    lp = np.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]  # [B, S]
    return -np.mean(lp[:, start:], axis=1) / np.log(2)


def evaluate(cfg: ModelConfig, params, budgets, *, length: int, depths, samples: int, text: np.ndarray,
             keys: int = 2, template: str = "held_out", chosen: Mapping[str, selection.Policy | None] | None = None,
             ledger: str | pathlib.Path | None = None, log=lambda _: None) -> list[dict]:
    """The baseline table: one row per (budget, policy of `chosen`, default `policies()`) with `budget_use` on the
    pass-key prompts (means over prompts; `use_intervals`: {measure: interval} over them,
    `infer.stats.prompt_intervals`), pass-key and `keys`-needle scores (means over depths; `by_depth` per depth
    `depth_key(d)`: {exact, digits, bits, needle}; `needle` = `needle_reads`; `<task>_intervals`: {measure:
    interval} over the `samples · len(depths)` prompts, `infer.stats.prompt_intervals`), bits per byte of `text [B =
    len(depths), length + digits]` scored from its middle on (`bpb_interval` over its rows; None with one row), the
    per-prompt values behind the quality figures (`per_prompt`, for `paired`) and the row's `seconds`. A measure
    with no qualifying query (NaN) is left out of its row.

    Every run of one (budget, policy) shares one compiled program (the same shapes; the start is traced). The
    retrieval prompts are worded by `template` (`retrieval_examples`). A row the `ledger` (`experiments.ledger`)
    records under the same setup (the digest of `params`, the config, the sizes, the text, the policy's settings)
    is read from it; otherwise it is measured and recorded, so a long table resumes where a run stopped."""
    passkeys = retrieval_examples(length, depths, samples, template=template)
    needles = retrieval_examples(length, depths, samples, keys=keys, template=template)
    setup = {"params": ledger_lib.tree_digest(params), "length": length, "depths": [float(d) for d in depths],
             "samples": samples, "keys": keys, "template": template,
             "text": hashlib.sha256(np.ascontiguousarray(text, np.int32).tobytes()).hexdigest()[:16]}
    rows = []
    for budget in budgets:
        at = cfg.replace(index_topk=budget)
        for name, policy in (policies() if chosen is None else chosen).items():
            recipe = {**setup, "config": config_fingerprint(at), "policy": name, "settings": repr(policy)}
            row = ledger_lib.cached(ledger, recipe, "row", lambda: measure_row(
                at, params, name, policy, depths, passkeys, needles, text, length))
            log(f"budget {budget} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                                                         if isinstance(v, float)))
            rows.append(row)
    return rows


def measure_row(cfg: ModelConfig, params, name: str, policy: selection.Policy | None, depths, passkeys, needles,
                text: np.ndarray, length: int) -> dict:
    """One row of `evaluate` at `cfg.index_topk`, measured."""
    t0 = time.perf_counter()
    start = length - 1  # every answer digit is predicted under the policy
    row = {"budget": cfg.index_topk, "policy": name, "evicts": bool(policy is not None and policy.evicts),
           "per_prompt": {}}
    uses = []
    for task, examples in (("passkey", passkeys), ("needles", needles)):
        scores = []
        for tokens, answers in examples:
            logprobs, rec = run(cfg, params, tokens, policy, start)
            spans = [needle_span(prompt[:start], a) for prompt, a in zip(tokens, answers)]
            scores.append({**answer_scores(logprobs, answers, start),
                           "needle": needle_reads(cfg, rec, spans, start, answers.shape[1])})
            if task == "passkey":
                uses.append(budget_use(cfg, rec, policy, start))
        merged = {k: np.mean([s[k] for s in scores], axis=0) for k in scores[0]}  # [depths]
        per_prompt = {k: np.concatenate([s[k] for s in scores]) for k in scores[0]}
        row.update({f"{task}_{k}": float(np.mean(v)) for k, v in merged.items()})
        row[f"{task}_intervals"] = stats.prompt_intervals(per_prompt, shares=("exact",))
        row[f"{task}_by_depth"] = {depth_key(d): {k: float(v[i]) for k, v in merged.items()}
                                   for i, d in enumerate(depths)}
        row["per_prompt"][task] = {k: v.tolist() for k, v in per_prompt.items()}
    use = {k: np.concatenate([u[k] for u in uses]) for k in uses[0]}  # [prompts] each
    row.update({k: float(np.mean(v)) for k, v in use.items()})
    row["use_intervals"] = stats.prompt_intervals(use)
    logprobs, _ = run(cfg, params, text[:, :-1], policy, length // 2)
    per_row = bits_per_byte(logprobs, text[:, 1:], length // 2)
    row["bpb"] = float(np.mean(per_row))
    row["bpb_interval"] = (stats.prompt_intervals({"bpb": per_row}) or {}).get("bpb")
    row["per_prompt"]["bpb"] = per_row.tolist()
    row["seconds"] = time.perf_counter() - t0
    return {k: v for k, v in row.items() if not (isinstance(v, float) and np.isnan(v))}


def depth_key(depth: float) -> str:
    """The key of a needle depth in a row's `<task>_by_depth` (a JSON object's keys are strings)."""
    return str(float(depth))


USE = ("reads", "distinct", "kept", "recall", "lost")  # the `budget_use` columns
COLUMNS = ("reads", "kept", "recall", "lost", "passkey_needle", "passkey_digits", "passkey_bits", "needles_needle",
           "needles_digits", "needles_bits", "bpb")


def interval_of(row: dict, column: str) -> dict | None:
    """The interval `evaluate` stored for `column` of `row` (`passkey_digits` → `passkey_intervals["digits"]`,
    `recall` → `use_intervals["recall"]`, `bpb` → `bpb_interval`), or None for a column without one (a single
    prompt)."""
    if column == "bpb":
        return row.get("bpb_interval")
    if column in USE:
        return (row.get("use_intervals") or {}).get(column)
    task, _, measure = column.partition("_")
    return (row.get(f"{task}_intervals") or {}).get(measure)


def per_prompt(row: dict, column: str) -> np.ndarray:
    """The per-prompt values behind `column` of `row` (`passkey_digits` → each prompt's share of digits right,
    `bpb` → each text row's bits per byte)."""
    if column == "bpb":
        return np.asarray(row["per_prompt"]["bpb"])
    task, _, measure = column.partition("_")
    return np.asarray(row["per_prompt"][task][measure])


def paired(row: dict, base: dict, column: str) -> dict:
    """`row − base` in `column`, prompt by prompt on the prompts (or text rows) both were measured on: the mean
    difference and its bootstrap interval over prompts (`infer.stats.mean_interval`, as `Interval.as_dict`, 4
    decimals: a gap in bits per byte is small)."""
    a, b = per_prompt(row, column), per_prompt(base, column)
    if a.shape != b.shape:
        raise ValueError(f"paired: {row['policy']} has {a.shape[0]} prompts in {column}, {base['policy']} "
                         f"{b.shape[0]}; compare rows measured on the same prompts")
    return stats.mean_interval(a - b).as_dict(4)


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    """The table as text, one line per (budget, policy); a column with an interval shows `value [lo, hi]`, and a
    last line states each such column's n (prompts, or rows of text for `bpb`) and level."""
    shown = {c: iv for c in columns if (iv := interval_of(rows[0], c))}  # the columns that carry an interval
    name = max(13, *(len(r["policy"]) + 1 for r in rows))

    def cell(r, c):
        iv = interval_of(r, c)
        return f"{r.get(c, np.nan):.3f}" if iv is None else stats.interval_text(iv, ".3f")

    widths = {c: max(len(c), *(len(cell(r, c)) for r in rows)) + 2 for c in columns}
    lines = [f"{'budget':>6} {'policy':<{name}}" + "".join(f"{c:>{widths[c]}}" for c in columns)]
    lines += [f"{r['budget']:>6} {r['policy']:<{name}}" + "".join(f"{cell(r, c):>{widths[c]}}" for c in columns)
              for r in rows]
    notes = sorted({("budget use" if c in USE else c.partition("_")[0], iv["n"], iv["level"])  # "bpb" stays
                    for c, iv in shown.items()})
    if notes:
        lines.append("intervals: " + "; ".join(f"{name} n = {n} at {level:.0%}" for name, n, level in notes))
    return "\n".join(lines)
