"""Top-K under the microscope (SPEC §5): how much of the attention that matters each layer's selection finds.

`probe` runs the model once (`csa2.model.forward(..., instrument=ProbeStats())`, SPEC §8 numerics) and returns
every layer's statistics (`research.probe_stats.Summary`): the dense attention mass each query's selections
capture, reduced inside the compiled model, so a probe costs O(S·K) memory and reaches 16K-token prompts. The
measures below are host-side arithmetic on those statistics:

- recall(set) = Σ_{e ∈ set} mass_e / Σ_e mass_e: the share of the Global attention mass the set captures;
- oracle: the `index_topk` entries of largest mass, the best any selection of that size reaches;
- pool recall: recall of the candidate pool; inside-pool recall: recall(top-k) / recall(pool);
- for a Reuse layer, the shared top-k (chosen by its index source's indexer) against its own mass.

Only queries where selection matters count: more visible entries than `index_topk` (below that every
selection holds every visible entry and its recall is 1 by construction; a sweep uses its largest
`index_topk` for every point, so all points count the same queries), and some Global mass.

Every figure is a mean over counted queries pooled over prompts (per layer in `layer_table`; per role, pooling its
layers, in `by_role`, `recall_by_position` and `distance_by_role`) and comes with a 95 % interval from resampling
the prompts, the independent unit (`pooled_intervals`): queries of one prompt are not.

`selected`, `recall`, `oracle` and `overlap` are the same measures on the full per-entry records of
`research.probe.Probes` (host arrays `[..., N]`), for short prompts and per-entry maps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import model
from csa2.config import ModelConfig
from csa2.indexer import visible_entries
from csa2.layout import layer_plan
from infer import stats
from research.probe_stats import ProbeStats, Summary


def probe(cfg: ModelConfig, params, tokens, edges=()) -> Summary:
    """Every layer's statistics for prompts `tokens [B, S]`, as host arrays `[L, B, S, ·]`; `edges`: the
    token-distance bins of `distance_by_role`."""
    instrument = ProbeStats(edges=tuple(int(e) for e in edges))
    _, aux = model.forward(cfg, params, jnp.asarray(tokens, jnp.int32), qat=True, instrument=instrument)
    return jax.tree.map(np.asarray, aux["tap"])


def share(part: np.ndarray, total: np.ndarray) -> np.ndarray:
    """`part / total`, NaN where `total` is 0 (a query with no Global mass)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, part / total, np.nan)


def selected(ids: np.ndarray, n: int) -> np.ndarray:
    """The valid ids `[..., K]` (−1 = none) as a mask `[..., n]`."""
    ids = np.asarray(ids)
    mask = np.zeros((*ids.shape[:-1], n), bool)
    lead = np.indices(ids.shape[:-1])
    for j in range(ids.shape[-1]):
        np.logical_or.at(mask, (*lead, np.maximum(ids[..., j], 0)), ids[..., j] >= 0)
    return mask


def captured(mass: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Σ of `mass [..., N]` over the valid ids `[..., K]` (each id counted once)."""
    return np.sum(np.where(selected(ids, mass.shape[-1]), mass, 0.0), axis=-1)


def recall(mass: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Share of the total mass `[..., N]` that `ids [..., K]` captures; NaN where there is no mass."""
    return share(captured(mass, ids), np.sum(mass, axis=-1))


def oracle(mass: np.ndarray, k: int) -> np.ndarray:
    """The `k` entries of largest mass, ascending, −1 where fewer than k carry mass."""
    order = np.argsort(-mass, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(mass, order, axis=-1)
    ids = np.sort(np.where(top > 0, order, np.iinfo(np.int32).max), axis=-1)
    ids = np.where(ids == np.iinfo(np.int32).max, -1, ids)
    return np.pad(ids, [(0, 0)] * (ids.ndim - 1) + [(0, k - ids.shape[-1])], constant_values=-1).astype(np.int32)


def overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a ∩ b| / |b| per query over the valid ids of `[..., K]` selections; NaN where b is empty."""
    a, b = np.asarray(a), np.asarray(b)
    hit = np.any((b[..., :, None] == a[..., None, :]) & (b[..., :, None] >= 0), axis=-1)
    size = np.sum(b >= 0, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(size > 0, np.sum(hit, axis=-1) / size, np.nan)


def counted(cfg: ModelConfig, layer: int, rec: Summary, min_visible: int | None = None) -> np.ndarray:
    """The queries `[B, S]` of `layer` that count: more visible entries than `min_visible` (default
    `index_topk`), and some Global mass."""
    total = rec.total[layer]
    visible = visible_entries(np.arange(total.shape[-1]), layer_plan(cfg)[layer].ratio)
    bound = cfg.index_topk if min_visible is None else min_visible
    return (visible > bound)[None, :] & (total > 0)


MEASURES = ("recall", "oracle", "overlap", "scan", "pool", "inside_pool")


def _mean(x: np.ndarray, where: np.ndarray) -> float:
    return float(np.mean(x[where])) if np.any(where) else float("nan")


def _per_prompt(x: np.ndarray, where: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Σ of `x [B, S]` over the counted queries `where [B, S]` of each prompt, and their number, `[B]` each."""
    return np.sum(np.where(where, x, 0.0), axis=1), np.sum(where, axis=1)


def layer_table(cfg: ModelConfig, rec: Summary, min_visible: int | None = None) -> list[dict]:
    """Per layer reading Global KV: role, its top-k source, queries counted and the mean over them of
    `recall` (what it read), `oracle` (best K-subset), `overlap` (share of the oracle's entries it read),
    `scan` (its own indexer over every visible entry; index sources), `pool` and `inside_pool` (layers
    that read a candidate pool's selection: Reindex layers and their Reuse layers; NaN where a measure does not
    apply). `per_prompt` holds, per measure that applies, its sum over each prompt's counted queries and their
    number (`[B]` each), what `by_role` pools; `intervals` each measure with its 95 % interval over prompts
    (`pooled_intervals`)."""
    rows = []
    for layer, spec in enumerate(layer_plan(cfg)):
        if spec.role == "swa":
            continue
        total = rec.total[layer]
        where = counted(cfg, layer, rec, min_visible)
        values = {"recall": (share(rec.read[layer], total), where), "oracle": (share(rec.oracle[layer], total), where),
                  "overlap": (rec.overlap[layer], where)}
        if spec.role in ("full", "reindex"):
            values["scan"] = (share(rec.scan[layer], total), where)
        source = spec.index_source
        if source is not None and layer_plan(cfg)[source].uses_candidates:
            pool = rec.pool[layer]
            values["pool"] = (share(pool, total), where)
            values["inside_pool"] = (share(rec.read[layer], pool), where & (pool > 0))
        row = {"layer": layer, "role": spec.role, "ratio": spec.ratio, "topk_from": source,
               "queries": int(np.sum(where))}
        row.update({key: _mean(*values[key]) if key in values else float("nan") for key in MEASURES})
        row["per_prompt"] = {key: _per_prompt(*v) for key, v in values.items()}
        row["intervals"] = pooled_intervals(row["per_prompt"])
        rows.append(row)
    return rows


def pooled_intervals(per_prompt: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, dict] | None:
    """{measure: the pooled rate Σ sums / Σ counts with its 95 % interval from resampling the prompts
    (`infer.stats.ratio_interval`, as `Interval.as_dict()`)} for `per_prompt` {measure: (sums, counts), `[B]`
    each}; a measure without any count is left out; None with one prompt (an interval needs two)."""
    if per_prompt and len(next(iter(per_prompt.values()))[1]) < 2:
        return None
    pooled = {key: v for key, v in per_prompt.items() if np.sum(v[1]) > 0}
    if not pooled:
        return {}
    num, den = (np.stack([v[i] for v in pooled.values()], axis=1) for i in (0, 1))
    return {key: iv.as_dict() for key, iv in zip(pooled, stats.ratio_interval(num, den))}


def by_role(rows: list[dict]) -> dict[str, dict]:
    """`layer_table` rows pooled per role: each measure the mean over the counted queries of the role's layers
    (NaN where it applies to none) and, in `intervals`, that mean with its 95 % interval from resampling the
    prompts (`pooled_intervals`; None with one prompt)."""
    out = {}
    for role in dict.fromkeys(r["role"] for r in rows):
        sel = [r for r in rows if r["role"] == role]
        out[role] = {"layers": [r["layer"] for r in sel], "queries": int(sum(r["queries"] for r in sel))}
        pooled = {}  # measure: (Σ over the role's counted queries, their number), [B] each
        for key in MEASURES:
            parts = [r["per_prompt"][key] for r in sel if key in r["per_prompt"]]
            if parts:
                pooled[key] = (sum(x for x, _ in parts), sum(c for _, c in parts))
            has = key in pooled and np.sum(pooled[key][1]) > 0
            out[role][key] = float(np.sum(pooled[key][0]) / np.sum(pooled[key][1])) if has else float("nan")
        out[role]["intervals"] = pooled_intervals(pooled)
    return out


def _roles(cfg: ModelConfig) -> dict[str, list[int]]:
    """The layers of each role that reads Global KV, in layer order."""
    out: dict[str, list[int]] = {}
    for layer, spec in enumerate(layer_plan(cfg)):
        if spec.role != "swa":
            out.setdefault(spec.role, []).append(layer)
    return out


def recall_by_position(cfg: ModelConfig, rec: Summary, edges) -> dict[str, dict]:
    """Per role: the mean `recall` of what its layers read and of the `oracle`, over their counted queries whose
    position lies in each bin `[edges[i], edges[i+1])`, as `pooled_intervals` per bin (`"recall"`, `"oracle"`:
    one {measure: interval} per bin, None with one prompt; `"value"`: the two means per bin, NaN for an empty
    bin): how selection holds up as the context grows."""
    edges = np.asarray(edges)
    out = {}
    for role, layers in _roles(cfg).items():
        per_layer = [(counted(cfg, layer, rec), {key: share(got, rec.total[layer]) for key, got in
                                                 (("recall", rec.read[layer]), ("oracle", rec.oracle[layer]))})
                     for layer in layers]  # each layer's counted queries [B, S] and per-query shares [B, S]
        pos = np.arange(rec.total.shape[-1])
        parts = []  # per bin: {measure: (sums [B], counts [B])} pooled over the role's layers
        for lo, hi in zip(edges[:-1], edges[1:]):
            sums = [{key: _per_prompt(x, where & (pos >= lo) & (pos < hi)) for key, x in shares.items()}
                    for where, shares in per_layer]
            parts.append({key: (sum(p[key][0] for p in sums), sum(p[key][1] for p in sums))
                          for key in ("recall", "oracle")})
        out[role] = {"edges": edges.tolist(),
                     "value": {key: [float(np.sum(p[key][0]) / np.sum(p[key][1])) if np.sum(p[key][1]) else
                                     float("nan") for p in parts] for key in ("recall", "oracle")},
                     "intervals": [pooled_intervals(p) for p in parts]}
    return out


def distance_by_role(cfg: ModelConfig, rec: Summary) -> dict[str, dict]:
    """Per role: its Global attention mass by token distance from the query (the bins `probe` was given) and the
    part of it its top-k missed, each a share of the role's total Global mass over the counted queries, pooled
    over its layers, per bin as `pooled_intervals` (`"mass"`, `"missed"`; None with one prompt) and as values:
    where attention goes and where selection loses it."""
    if rec.by_distance is None:
        raise ValueError("distance_by_role: these statistics have no distance bins; give probe(..., edges=)")
    out = {}
    for role, layers in _roles(cfg).items():
        dist = sum(rec.by_distance[layer] for layer in layers)  # [B, 2, bins]: mass, and the part missed
        total = sum(np.sum(np.where(counted(cfg, layer, rec), rec.total[layer], 0.0), axis=1) for layer in layers)
        whole = max(float(np.sum(total)), 1e-30)
        out[role] = {"mass": (np.sum(dist[:, 0], axis=0) / whole).tolist(),
                     "missed": (np.sum(dist[:, 1], axis=0) / whole).tolist(),
                     "intervals": [pooled_intervals({"mass": (dist[:, 0, i], total), "missed": (dist[:, 1, i], total)})
                                   for i in range(dist.shape[-1])]}
    return out


def sweep(cfg: ModelConfig, params, tokens, field: str, values) -> list[dict]:
    """`layer_table` averaged `by_role` for the model run with `cfg.<field>` = each value (`index_topk`,
    `candidate_block_size`, `candidate_topk_blocks`: no parameter depends on them, so the trained weights
    serve every point; each point is a real run of the model at that setting)."""
    if field not in {f.name for f in dataclasses.fields(cfg)}:
        raise ValueError(f"sweep: field={field!r} is not a ModelConfig field; sweep index_topk, "
                         "candidate_block_size or candidate_topk_blocks")
    configs = [cfg.replace(**{field: value}) for value in values]
    bound = max(c.index_topk for c in configs)
    return [{field: value, "roles": by_role(layer_table(c, probe(c, params, tokens), bound))}
            for value, c in zip(values, configs)]
