"""The exactness bound of bounded replay (SPEC §11, `csa2.replay.exact_window`): from R = D·(W − 1) + 1 on, the
last position of a bounded prefill is the exact prefill's; a window of W − 1 fewer positions per tail layer cuts
into its receptive field."""

import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.replay import EXACT, ReplayPolicy, exact_window
from csa2.state import init_state

N = 100  # prompt tokens: longer than every window below


def test_the_bound_counts_the_tail_layers(mini, tiny):
    assert exact_window(mini) == 4 * 15 + 1  # layers 4-7 on the tail, W = 16
    assert exact_window(mini, split_layer=5) == 3 * 15 + 1
    assert exact_window(tiny) == 20 * 15 + 1  # layers 20-39 on the tail, W = 16
    with pytest.raises(ValueError, match="split_layer=2"):
        exact_window(mini, split_layer=2)


@pytest.fixture(scope="module")
def last_logits(mini, mini_params):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, N)), jnp.int32)

    def last(policy: ReplayPolicy) -> np.ndarray:
        logits, _, _ = model.prefill(mini, mini_params, init_state(mini, 2, 128, "float"), tokens, replay=policy,
                                     numerics="float")
        return np.asarray(logits)
    return last


@pytest.mark.parametrize("split", [None, 5])
def test_the_last_position_is_exact_from_the_bound_on(mini, last_logits, split):
    bound = exact_window(mini, split)
    exact = last_logits(EXACT)
    np.testing.assert_allclose(last_logits(ReplayPolicy(window=bound, split_layer=split)), exact, atol=1e-6, rtol=0)
    tail_layers = mini.num_hidden_layers - ReplayPolicy(split_layer=split).split(mini)
    short = bound - (mini.sliding_window - 1) * (tail_layers - 1)  # the last position sees truncated windows
    assert np.abs(last_logits(ReplayPolicy(window=short, split_layer=split)) - exact).max() > 1e-4
