"""Research instruments above the model: what a layer reads instead of its own top-k, and what it records.

Each is a `csa2.hooks.Instrument` passed to `csa2.model.forward(..., instrument=)`; the core imports none of them.
`selection`: the KV-selection baselines of SPEC §14 (`KVSelection(policy, start)`); `probe`: every layer's dense
attention mass next to what it read (`Probes()`); `probe_stats`: the same mass reduced inside the model to the
per-query measures of `experiments.topk` (`ProbeStats()`, O(S·K) memory).
"""
