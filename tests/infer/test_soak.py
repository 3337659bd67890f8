"""infer.soak on `mini`: a generation that wraps the rings, checked against exact re-prefills, ends in a clear
capacity error."""

import pytest

from csa2.presets import preset
from infer import soak


def test_soak_agrees_with_re_prefills_and_refuses_past_capacity(mini_params):
    """40 tokens after an 8-token prompt wrap every 21-slot ring twice; each check (at 16, 32, 40 generated) agrees
    with an exact re-prefill of the same tokens to the SPEC §8 rounding, with the same greedy token; the 49th
    position is refused by name."""
    lines = []
    summary = soak.soak(preset("mini"), mini_params, tokens=40, check_every=16, prompt_len=8, chunk=16,
                        log=lines.append)
    assert summary["checks"] == 3 and summary["greedy_agreements"] == 3 and len(lines) == 4
    assert summary["ring_wraps"] == 2 and summary["capacity"] == 48
    assert summary["max_abs_logit_diff"] <= 1e-2
    assert "beyond the state capacity 48" in summary["capacity_refusal"]


def test_soak_refuses_bad_sizes(mini_params):
    with pytest.raises(ValueError, match="check_every=0 must be ≥ 1"):
        soak.soak(preset("mini"), mini_params, tokens=4, check_every=0, prompt_len=8, chunk=16)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        soak.soak(preset("mini"), mini_params, tokens=10**6, check_every=1, prompt_len=8, chunk=16)
