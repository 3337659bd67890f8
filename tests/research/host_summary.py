"""`research.probe_stats.Summary` by its definitions, in NumPy, from a full `research.probe.Probes` record: the
reference the compiled statistics are checked against, and the way hand cases are built."""

import numpy as np

from csa2.config import ModelConfig
from csa2.layout import layer_plan
from experiments import topk
from research.probe import Probe
from research.probe_stats import Summary


def summary(cfg: ModelConfig, rec: Probe, edges=()) -> Summary:
    """The statistics of every layer of `rec` (host arrays `[L, B, S, ·]`); `edges`: the distance bins."""
    fields = {k: [] for k in ("total", "read", "oracle", "overlap", "scan", "pool", "by_distance")}
    for layer, spec in enumerate(layer_plan(cfg)):
        mass, ids = np.asarray(rec.mass[layer], np.float64), np.asarray(rec.topk[layer])  # [B, S, N], [B, S, K]
        b, s, n = mass.shape
        best = topk.oracle(mass, cfg.index_topk)
        fields["total"].append(mass.sum(-1))
        fields["read"].append(topk.captured(mass, ids))
        fields["oracle"].append(topk.captured(mass, best))
        fields["overlap"].append(topk.overlap(ids, best))
        has_scan = spec.role in ("full", "reindex")
        fields["scan"].append(topk.captured(mass, rec.scan[layer]) if has_scan else np.zeros((b, s)))
        fields["pool"].append(topk.captured(mass, rec.pool[layer]))
        sums = np.zeros((b, 2, max(len(edges) - 1, 0)))
        if spec.role != "swa":
            visible = (np.arange(s) + 1) // spec.ratio  # SPEC §4
            counts = (visible > cfg.index_topk)[None, :] & (mass.sum(-1) > 0)  # [B, S]
            # entry e of a ratio-r source covers tokens [e·r, (e+1)·r): distance to its last token
            dist = np.arange(s)[:, None] - ((np.arange(n) + 1) * spec.ratio - 1)[None, :]
            weights = np.where(counts[..., None], mass, 0.0)
            missed = ~topk.selected(ids, n)
            for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
                inside = (dist >= lo) & (dist < hi)
                sums[:, 0, i] = np.sum(np.where(inside, weights, 0.0), axis=(1, 2))
                sums[:, 1, i] = np.sum(np.where(inside & missed, weights, 0.0), axis=(1, 2))
        fields["by_distance"].append(sums)
    stacked = {k: np.stack(v) for k, v in fields.items()}
    if not edges:
        stacked["by_distance"] = None
    return Summary(**stacked, topk=np.asarray(rec.topk))
