"""DSpark speculative decoding (SPEC §12): greedy speculative ≡ greedy `generate` token for token (batch sizes, γ,
scheduled widths, EOS), stochastic acceptance has the target's distribution (chi-square), bad input.

The drafter of `mini_params` is random, so it is made to agree with the target often: its Markov head echoes the
previous token for the tokens the greedy target emits (the random target repeats itself), which makes accepted
runs, rejections and bonus tokens all common.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from csa2 import model
from csa2.config import preset
from csa2.tokenizer import encode
from infer.generate import Sampling, generate
from infer.schedule import SpsTable, config_fingerprint
from infer.speculative import accept, speculative_generate

MINI = preset("mini")
META = {"config": config_fingerprint(MINI)}
NEW = 24
PROMPT_SETS = (("hello world", "abcdefgh", "The with statement"), ("class ", "0123456789", "xyz"))


def _prompts(texts, batch):
    return [encode(t) for t in texts[:batch]]


@pytest.fixture(scope="module")
def params(mini_params):
    """`mini_params` with a Markov head that echoes the previous token for the tokens greedy decoding emits."""
    emitted = set()
    for texts in PROMPT_SETS:
        emitted |= set(generate(MINI, mini_params, _prompts(texts, 3), max_new_tokens=NEW, eos_id=None).tokens.ravel()
                       .tolist())
    echo = sorted(emitted)[:MINI.dspark_markov_rank]
    pure = nnx.to_pure_dict(mini_params)
    w1 = np.zeros(pure[model.DRAFTER]["markov_embed"].shape, np.float32)
    w2 = np.zeros(pure[model.DRAFTER]["markov_head"].shape, np.float32)
    for i, t in enumerate(echo):
        w1[t, i], w2[i, t] = 1.0, 50.0
    pure[model.DRAFTER]["markov_embed"], pure[model.DRAFTER]["markov_head"] = jnp.asarray(w1), jnp.asarray(w2)
    out = jax.tree.map(lambda x: x, mini_params)
    nnx.replace_by_pure_dict(out, pure)
    return out


@pytest.fixture(scope="module")
def plain(params):
    """Greedy `generate` of each prompt set at batch 1 and 3 (one compile per batch size)."""
    return {(texts, batch): generate(MINI, params, _prompts(texts, batch), max_new_tokens=NEW, eos_id=None)
            for texts in PROMPT_SETS for batch in (1, 3)}


def _assert_same_output(spec, ref):
    np.testing.assert_array_equal(spec.tokens, ref.tokens)
    np.testing.assert_array_equal(spec.lengths, ref.lengths)
    np.testing.assert_array_equal(spec.state.length, ref.state.length)


@pytest.mark.parametrize("batch, gamma", [(1, 5), (3, 2)])
def test_greedy_speculative_equals_greedy_generate(params, plain, batch, gamma):
    accepted = 0
    for texts in PROMPT_SETS:
        spec = speculative_generate(MINI, params, _prompts(texts, batch), max_new_tokens=NEW, eos_id=None, gamma=gamma)
        _assert_same_output(spec, plain[texts, batch])
        assert spec.position_tries[gamma:].sum() == 0  # drafts past γ are never verified
        assert spec.steps < NEW - 1  # accepted drafts saved steps
        accepted += int(spec.accepted.sum())
    assert accepted > 0


def test_scheduled_widths_keep_greedy_output_and_eos(params, plain):
    table = SpsTable(widths=(3, 6), steps_per_s={3: (30.0, 20.0)}, meta=META)
    for texts in PROMPT_SETS:
        spec = speculative_generate(MINI, params, _prompts(texts, 3), max_new_tokens=NEW, eos_id=None, sps=table)
        _assert_same_output(spec, plain[texts, 3])
        assert spec.widths.sum() == spec.steps
    # EOS: a token row 0 emits mid-way ends that row there and nowhere else, exactly as in `generate`.
    texts = PROMPT_SETS[0]
    eos = int(plain[texts, 3].tokens[0, NEW // 2])
    ref = generate(MINI, params, _prompts(texts, 3), max_new_tokens=NEW, eos_id=eos)
    spec = speculative_generate(MINI, params, _prompts(texts, 3), max_new_tokens=NEW, eos_id=eos, sps=table)
    assert ref.lengths[0] <= NEW // 2 + 1
    _assert_same_output(spec, ref)


def test_greedy_acceptance_rule():
    """One-hot p and q: accept while d_i is the target's argmax, at most `cap`; the bonus is the target's argmax at
    row n."""
    v = 6
    target = jax.nn.one_hot(jnp.asarray([[1, 2, 3, 4]] * 3), v)  # row i predicts token i + 1
    drafts = jnp.asarray([[1, 2, 5], [1, 2, 3], [1, 2, 3]])
    n, bonus = accept(target, jax.nn.one_hot(drafts, v), drafts, jnp.asarray([3, 3, 1]), jax.random.PRNGKey(0))
    np.testing.assert_array_equal(n, [2, 3, 1])
    np.testing.assert_array_equal(bonus, [3, 4, 2])


def test_stochastic_acceptance_has_the_target_distribution():
    """Drafts drawn from q, accepted by min(1, p/q), residual norm(max(p − q, 0)): the first emitted token follows
    p_0, and the second (when one draft was accepted) follows p_1 (chi-square, 40 000 rows, vocabulary 5)."""
    rows, v, gamma = 40_000, 5, 2
    kp, kq, kd, ka = jax.random.split(jax.random.PRNGKey(0), 4)
    p = jax.nn.softmax(2 * jax.random.normal(kp, (gamma + 1, v)))
    q = jax.nn.softmax(2 * jax.random.normal(kq, (gamma, v)))
    drafts = jax.random.categorical(kd, jnp.log(q), shape=(rows, gamma)).astype(jnp.int32)
    target, draft = jnp.broadcast_to(p, (rows, gamma + 1, v)), jnp.broadcast_to(q, (rows, gamma, v))
    n, bonus = accept(target, draft, drafts, jnp.full((rows,), gamma), ka)
    n, bonus, drafts = np.asarray(n), np.asarray(bonus), np.asarray(drafts)
    first = np.where(n >= 1, drafts[:, 0], bonus)
    second = np.where(n >= 2, drafts[:, 1], bonus)[n >= 1]
    for got, want in ((first, p[0]), (second, p[1])):
        counts = np.bincount(got, minlength=v)
        want = np.asarray(want, np.float64)
        assert stats.chisquare(counts, want / want.sum() * counts.sum()).pvalue > 1e-3
    # The same rule with q = p accepts everything: no token is ever resampled.
    n_same, _ = accept(target, target[:, :gamma], drafts, jnp.full((rows,), gamma), ka)
    assert np.all(np.asarray(n_same) == gamma)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma=6), "gamma=6.*max_draft"),
    (dict(gamma=-1), "gamma=-1"),
    (dict(sps=SpsTable(widths=(2, 7), steps_per_s={1: (2.0, 1.0)}, meta=META)), "widest verify block"),
    (dict(gamma=2, sps=SpsTable(widths=(2,), steps_per_s={1: (1.0,)}, meta=META)), "not both"),
    (dict(sps=SpsTable(widths=(2, 6), steps_per_s={8: (2.0, 1.0)}, meta=META)), "batch size 1"),
    (dict(sps=SpsTable(widths=(2, 6), steps_per_s={1: (2.0, 1.0)}, meta={"config": "tiny"})), "another config"),
    (dict(sps={"widths": (2,)}), "SpsTable"),
    (dict(sampling=Sampling(temperature=0.5), gamma=2.5), "gamma=2.5"),
])
def test_bad_input_raises_value_error(mini_params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        speculative_generate(MINI, mini_params, [encode("hi")], max_new_tokens=4, **kwargs)


def test_config_without_a_drafter_is_refused(mini_params):
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        speculative_generate(MINI.replace(num_nextn_predict_layers=0), mini_params, [encode("hi")], max_new_tokens=4)
