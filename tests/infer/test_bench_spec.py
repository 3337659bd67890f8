"""`infer.bench_spec`'s held-out prompts and acceptance figures (SPEC §12's mean acceptance length, with n and a 95 %
interval over prompts)."""

import numpy as np
import pytest

from csa2.presets import BOS_ID
from infer import bench_spec
from infer.speculative import speculative_generate


def test_held_out_prompts_are_distinct_windows_of_the_validation_documents():
    prompts = bench_spec.validation_prompts(64, 32)
    assert len(prompts) == 64 and all(16 <= len(p) <= 32 for p in prompts)
    starts = [p for p in prompts if p[0] == BOS_ID]
    assert len(starts) == 8 and all(p[0] == BOS_ID for p in prompts[:8])  # each document's beginning first
    assert len({p.tobytes() for p in prompts}) == 64
    with pytest.raises(ValueError, match="n=100000: the validation documents give"):
        bench_spec.validation_prompts(100_000, 32)


def test_acceptance_pools_verify_steps_over_prompts(mini, mini_params):
    """Five prompts in batches of 2 (the last batch padded with a repeat, counted once): the acceptance length is
    Σ (accepted + steps) / Σ steps over the prompts' rows, per position accepted / reached, with intervals."""
    got = bench_spec.acceptance(mini, mini_params, 5, 12, 6, batch=2)
    prompts = bench_spec.validation_prompts(5, 12)
    res = [speculative_generate(mini, mini_params, prompts[i:i + 2] + prompts[4:] * (i == 4), max_new_tokens=6,
                                eos_id=None) for i in (0, 2, 4)]
    accepted = np.concatenate([r.accepted for r in res])[:5]
    steps = np.concatenate([r.row_steps for r in res])[:5]
    assert (steps > 0).all() and got["prompts"] == 5
    tau = got["acceptance_length"]
    assert tau["value"] == pytest.approx((accepted + steps).sum() / steps.sum(), abs=1e-3)
    assert tau["lo"] <= tau["value"] <= tau["hi"] and tau["n"] == 5 and tau["level"] == 0.95
    accepts = np.concatenate([r.position_accepts for r in res])[:5].sum(0)
    tries = np.concatenate([r.position_tries for r in res])[:5].sum(0)
    assert tries[0] == steps.sum()  # every verify step reaches draft 1
    for x, a, t in zip(got["position_acceptance"], accepts, tries):
        if t:
            assert x["value"] == pytest.approx(a / t, abs=1e-3)
        else:
            assert np.isnan(x["value"])
