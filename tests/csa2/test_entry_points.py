"""The public entry points: jitted, the state donated, arguments checked on the host before tracing (DESIGN §3, §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa2 import model
from csa2.index_loss import IndexLoss
from csa2.presets import preset
from csa2.replay import EXACT, ReplayPolicy
from csa2.state import init_state
from tests.csa2.helpers import keep, tokens

MINI = preset("mini")
CAP = 64


def test_decode_step_consumes_the_state(mini_params):
    _, state, _ = model.prefill(MINI, mini_params, init_state(MINI, 2, CAP), tokens(0, (2, 5)), replay=EXACT)
    kv = state.global_kv[1].kv.payload
    _, new = model.decode_step(MINI, mini_params, state, jnp.array([1, 2], jnp.int32))
    assert kv.is_deleted() and all(x.is_deleted() for x in jax.tree.leaves(state))
    assert not any(x.is_deleted() for x in jax.tree.leaves(new))
    # the undonated twin keeps its input and computes the same step
    again = keep(new)
    a, _ = model.decode_step.without_donation()(MINI, mini_params, again, jnp.array([3, 4], jnp.int32))
    b, _ = model.decode_step(MINI, mini_params, new, jnp.array([3, 4], jnp.int32))
    assert not any(x.is_deleted() for x in jax.tree.leaves(again))
    np.testing.assert_array_equal(a, b)


def test_verify_then_commit_shares_the_buffers(mini_params):
    """verify consumes the state and returns the speculative one; commit only sets lengths (no copy)."""
    _, state, _ = model.prefill(MINI, mini_params, init_state(MINI, 2, CAP), tokens(1, (2, 6)), replay=EXACT)
    _, spec = model.verify(MINI, mini_params, state, tokens(2, (2, 3)))
    with pytest.raises(ValueError, match=r"accept_lens=\[1, 4\].*width=\[3, 3\]"):
        model.commit(spec, jnp.array([1, 4], jnp.int32), jnp.array([5, 6], jnp.int32))  # row 1: 4 > 3 verified rows
    committed = model.commit(spec, jnp.array([1, 3], jnp.int32), jnp.array([5, 6], jnp.int32))
    assert committed.global_kv[0].kv.payload is spec.global_kv[0].kv.payload
    np.testing.assert_array_equal(committed.length, [7, 9])
    with pytest.raises(ValueError, match=r"width=\[0, 0\].*verify again"):  # a commit needs a verify of its own
        model.commit(committed, jnp.array([1, 1], jnp.int32), jnp.array([5, 6], jnp.int32))


def test_fork_is_one_gather_over_the_batch_axis(mini_params):
    _, state, _ = model.prefill(MINI, mini_params, init_state(MINI, 2, CAP), tokens(3, (2, 5)), replay=EXACT)
    forked = model.fork(state, jnp.array([1, 1, 0]))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(forked)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a)[[1, 1, 0]])


def test_value_checks_run_on_the_host_and_shape_checks_under_trace(mini_params):
    bad = jnp.full((2, 4), 300, jnp.int32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.prefill(MINI, mini_params, init_state(MINI, 2, CAP), bad)

    @jax.jit
    def traced(toks):  # values are unknown while tracing: only shapes are checked, the call compiles
        return model.prefill(MINI, mini_params, init_state(MINI, 2, CAP), toks, replay=EXACT)[2]["work"]

    assert int(traced(jnp.ones((2, 4), jnp.int32))) == MINI.num_hidden_layers * 8
    with pytest.raises(ValueError, match="one token per row"):
        jax.jit(lambda t: model.decode_step(MINI, mini_params, init_state(MINI, 2, CAP), t))(
            jnp.ones((2, 2), jnp.int32))


def test_trusted_call_checks_shapes_and_host_values_only(mini_params):
    """`.trusted` computes what the checked call does; it still refuses bad shapes and bad host (numpy) values,
    and reads no device value back: ids that only a device read would catch go through unchecked."""
    _, state, _ = model.prefill(MINI, mini_params, init_state(MINI, 2, CAP), tokens(4, (2, 5)), replay=EXACT)
    tok = jnp.array([3, 4], jnp.int32)
    a, _ = model.decode_step(MINI, mini_params, keep(state), tok)
    b, _ = model.decode_step.trusted(MINI, mini_params, keep(state), tok)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="one token per row"):
        model.decode_step.trusted(MINI, mini_params, keep(state), jnp.ones((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.prefill.trusted(MINI, mini_params, keep(state), np.full((2, 3), 300, np.int32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.decode_step(MINI, mini_params, keep(state), jnp.array([300, 1], jnp.int32))
    model.decode_step.trusted(MINI, mini_params, keep(state), jnp.array([300, 1], jnp.int32))


def test_lowered_entry_point_compiles_once_and_matches(mini_params):
    state = init_state(MINI, 2, CAP)
    tok = jnp.array([5, 6], jnp.int32)
    compiled = model.decode_step.lower(MINI, mini_params, keep(state), tok).compile()
    a, _ = compiled(mini_params, keep(state), tok)
    b, _ = model.decode_step(MINI, mini_params, state, tok)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, field", [
    (dict(window=-3), "window"), (dict(window=0), "window"), (dict(window=1.5), "window"),
    (dict(split_layer=-1), "split_layer"), (dict(split_layer="20"), "split_layer"),
    (dict(short_extend="fill"), "short_extend"),
])
def test_replay_policy_validates_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=f"ReplayPolicy.{field}"):
        ReplayPolicy(**kwargs)


def test_replay_policy_model_rules_are_checked_at_the_call(mini_params):
    policy = ReplayPolicy(window=4, split_layer=7)  # fine on its own; mini has 8 layers
    with pytest.raises(ValueError, match="split_layer=9"):
        model.prefill(MINI, mini_params, init_state(MINI, 1, CAP), jnp.ones((1, 4), jnp.int32),
                      replay=ReplayPolicy(split_layer=9))
    model.prefill(MINI, mini_params, init_state(MINI, 1, CAP), jnp.ones((1, 4), jnp.int32), replay=policy)


@pytest.mark.parametrize("call, message", [
    (lambda p: model.prefill(MINI, p, "state", jnp.ones((2, 4), jnp.int32)), "init_state"),
    (lambda p: model.prefill(MINI, p, init_state(MINI, 2, CAP), jnp.ones((2, 4), jnp.float32)), "integers"),
    (lambda p: model.prefill(MINI, p, init_state(MINI, 2, CAP), jnp.ones((2, 4), jnp.int32),
                             jnp.array([1, 5], jnp.int32)), "n_valid"),
    (lambda p: model.prefill(MINI, p, init_state(MINI, 2, CAP), jnp.ones((2, 4), jnp.int32),
                             jnp.array([1], jnp.int32)), "n_valid"),
    (lambda p: model.forward(MINI, p, jnp.ones((2, 4), jnp.int32), instrument=IndexLoss("full")), "IndexLoss.mode"),
    (lambda p: model.forward(MINI, p, jnp.full((2, 4), -1, jnp.int32)), "outside the vocabulary"),
    (lambda p: model.decode_step("mini", p, init_state(MINI, 2, CAP), jnp.ones((2,), jnp.int32)), "ModelConfig"),
])
def test_bad_arguments_name_the_field(mini_params, call, message):
    with pytest.raises(ValueError, match=message):
        call(mini_params)


def test_decode_step_checks_token_ids_on_the_host(mini_params):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.decode_step(MINI, mini_params, init_state(MINI, 2, CAP), jnp.array([1, 999], jnp.int32))


def test_entry_points_lower_from_abstract_values():
    """Ahead-of-time lowering from shapes only (nothing allocated): the host checks see no values."""
    params = model.abstract_params(MINI)
    state = jax.eval_shape(lambda: init_state(MINI, 2, CAP))
    lowered = model.decode_step.lower(MINI, params, state, jax.ShapeDtypeStruct((2,), jnp.int32))
    logits, out_state = lowered.out_info
    assert logits.shape == (2, MINI.vocab_size)
    assert jax.tree.map(lambda x: x.shape, out_state) == jax.tree.map(lambda x: x.shape, state)
