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
from csa2.presets import preset
from csa2.replay import ReplayPolicy
from csa2.tokenizer import encode
from infer import speculative as spec_module
from infer.generate import Sampling, generate
from infer.schedule import SpsTable, config_fingerprint
from infer.speculative import accept, speculative_generate
from tests.infer.drafters import echo_markov

MINI = preset("mini")
META = {"config": config_fingerprint(MINI)}
NEW = 24
PROMPT_SETS = (("hello world", "abcdefgh", "The with statement"), ("class ", "0123456789", "xyz"))


def _prompts(texts, batch):
    return [encode(t) for t in texts[:batch]]


@pytest.fixture(scope="module")
def params(mini_params):
    """`mini_params` with a Markov head that echoes the previous token for the tokens greedy decoding emits."""
    emitted = [generate(MINI, mini_params, _prompts(texts, 3), max_new_tokens=NEW, eos_id=None).tokens.ravel()
               for texts in PROMPT_SETS]
    return echo_markov(mini_params, np.concatenate(emitted), MINI.dspark_markov_rank)


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
        assert spec.position_tries[:, gamma:].sum() == 0  # drafts past γ are never verified
        # A row's NEW − 1 tokens after the first come n + 1 per verify step (the last step may be cut at the
        # budget), so its accepted drafts save exactly that many steps, never more.
        assert (spec.row_steps <= NEW - 1).all() and (spec.row_steps + spec.accepted >= NEW - 1).all()
        assert spec.steps == spec.row_steps.max()
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


# Prompts of 53, 33 and 4 tokens: two longer than mini's window W = 16, one shorter.
LONG_PROMPTS = ("hello world, " * 4, "abcdefgh" * 4, "xyz")


def test_speculative_prefill_replays_at_least_the_window(params):
    """A replay window R < W prefills as R = W (`csa2.replay.drafting_replay`): the drafter's first context needs W
    rows of decoder features. Greedy, R = 4 gives the tokens and acceptance statistics of R = W, and the decoder
    floor is max(length − W, 0) (R = 4 as given would leave it at length − 4 and the drafter 4 context rows)."""
    prompts = _prompts(LONG_PROMPTS, 3)
    w = MINI.sliding_window
    narrow, whole = (speculative_generate(MINI, params, prompts, max_new_tokens=NEW, eos_id=None,
                                          replay=ReplayPolicy(window=r)) for r in (4, w))
    _assert_same_output(narrow, whole)
    for name in ("steps", "accepted", "row_steps", "position_accepts", "position_tries", "widths"):
        np.testing.assert_array_equal(getattr(narrow, name), getattr(whole, name), err_msg=name)
    assert whole.accepted.sum() > 0
    lengths = np.asarray([len(p) for p in prompts])
    np.testing.assert_array_equal(narrow.state.floor, np.maximum(lengths - w, 0))  # no decode step moves it


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


# ---------------------------------------------------------------------------------------------
# Sampling end to end: `speculative_generate` at temperature 0.8, top-p 0.9 draws what `generate` draws

# mini's layer roles on 4 layers (SWA only; ratio-2 KV + index source with Engram; ratio-1 source with candidates;
# ratio-1 layer reading layer 2's KV with its own indexer), half the compile and run time of mini's 8, and a
# vocabulary of 8, so a chi-square over tokens has power. PAD (258) never enters the model: the 2-token prompt fills
# its bucket and there is no EOS; the Engram compressed vocabulary (259 ≥ 8) needs no table.
SMALL_V = 8
SMALL = preset("mini").replace(
    vocab_size=SMALL_V, dspark_noise_token_id=SMALL_V - 1, num_hidden_layers=4, compress_ratios=(0, 2, 1, 1),
    kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2, engram_layer_ids=(1,),
    dspark_target_layer_ids=(1, 2, 3))
SAMPLED = Sampling(temperature=0.8, top_p=0.9)
ROWS, SAMPLED_NEW = 2048, 3  # one prompt, 2048 independently drawn rows, 3 new tokens (2 from speculative steps)
SAMPLED_PROMPT = np.tile(np.asarray([3, 5], np.int32), (ROWS, 1))
# Verify widths 2 and 3 (at most 2 of γ = 5 drafts) at rates under which the two steps run one width each, with
# per-row lengths 1, 2 and 3 (the confidences of `small_params` differ per row).
SMALL_TABLE = SpsTable(widths=(2, 3), steps_per_s={ROWS: (30.0, 27.0)}, meta={"config": config_fingerprint(SMALL)})
# `speculative_loop`'s static arguments, after cfg
SPEC_STATIC = ("capacity", "max_new_tokens", "replay", "cache_format", "numerics", "widths")


@pytest.fixture(scope="module")
def small_params():
    """Random `SMALL` weights with a drafter that disagrees with the target often (acceptance ≈ 75 %, so the residual
    draw runs on a quarter of the verified drafts) and whose q has a tail that top-p cuts: the target's head ×2
    (p spread over ~7 of the 8 tokens), the drafter's final norm ×½ (a flatter q), no Markov term (W2 = 0), and
    W1[t] = e_t with a confidence head that reads only W1[prev], c_k = σ(z[x_{k−1}]), z from −1.5 to 1.5, so the
    scheduled lengths differ per row."""
    params = model.init_params(SMALL, jax.random.PRNGKey(0))
    pure = nnx.to_pure_dict(params)
    drafter = pure[model.DRAFTER]
    rank = drafter["markov_embed"].shape[1]
    pure["head"] = 2 * pure["head"]
    drafter["norm"] = 0.5 * drafter["norm"]
    drafter["markov_embed"] = jnp.eye(SMALL_V, rank, dtype=jnp.float32)
    drafter["markov_head"] = jnp.zeros_like(drafter["markov_head"])
    confidence = np.zeros(drafter["confidence"].shape, np.float32)  # w · [h ; W1[prev]]
    z = np.random.default_rng(0).permutation(np.linspace(-1.5, 1.5, SMALL_V))
    confidence[SMALL.hidden_size + np.arange(SMALL_V)] = z
    drafter["confidence"] = jnp.asarray(confidence)
    nnx.replace_by_pure_dict(params, pure)
    return params


@pytest.fixture(scope="module")
def sampled_plain(small_params):
    """Plain `generate` sampling of the 2048 rows (seed 1): the reference distribution."""
    return generate(SMALL, small_params, SAMPLED_PROMPT, max_new_tokens=SAMPLED_NEW, sampling=SAMPLED, eos_id=None,
                    seed=1).tokens


def _two_sample_chi_square(a: np.ndarray, b: np.ndarray) -> dict[str, tuple[float, int, float]]:
    """Two-sample chi-square tests (2 × K contingency tables) between new tokens `a`, `b` [B, 3] of two runs: the
    token at positions 1 and 2 (the speculative ones) and the pairs at positions (0, 1) and (1, 2). Cells with fewer
    than 10 draws in both runs together are pooled into one. Returns {name: (statistic, dof, p-value)}."""
    out = {}
    for name, cols in (("t1", [1]), ("t2", [2]), ("t01", [0, 1]), ("t12", [1, 2])):
        cell_a, cell_b = (np.ravel_multi_index(x[:, cols].T, (SMALL_V,) * len(cols)) for x in (a, b))
        size = SMALL_V ** len(cols)
        table = np.stack([np.bincount(cell_a, minlength=size), np.bincount(cell_b, minlength=size)])
        rare = table.sum(0) < 10
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        result = stats.chi2_contingency(table, correction=False)
        out[name] = (float(result.statistic), int(result.dof), float(result.pvalue))
    return out


# Observed (these seeds, deterministic), statistic/dof/p-value for t1, t2, t01, t12, and drafts accepted/verified at
# k = 1, 2:
#   gamma=2:  7.2/7/0.41  4.1/7/0.76  56.4/48/0.19  37.3/54/0.96; 1952/2507, 1369/1952 (78 %, 70 %)
#   schedule: 5.1/7/0.64  5.9/7/0.55  41.8/48/0.72  44.6/53/0.79; 1955/2507, 1364/1955, every step at width 3
@pytest.mark.parametrize("how", [dict(gamma=2, seed=2), dict(sps=SMALL_TABLE, seed=3)], ids=["gamma", "schedule"])
def test_sampled_speculative_output_has_the_distribution_of_generate(small_params, sampled_plain, how):
    """T = 0.8, top-p 0.9, untrained drafter: the speculative tokens follow plain sampling's distribution, per position
    and in pairs (two-sample chi-square, 2048 rows each, every p-value > 1e-3), with a fixed γ and with scheduled
    verify lengths capped below γ."""
    spec = speculative_generate(SMALL, small_params, SAMPLED_PROMPT, max_new_tokens=SAMPLED_NEW, sampling=SAMPLED,
                                eos_id=None, **how)
    assert np.all(spec.lengths == SAMPLED_NEW)
    tests = _two_sample_chi_square(sampled_plain, spec.tokens)
    assert min(p for _, _, p in tests.values()) > 1e-3, tests
    # Accepted drafts, rejected ones (the residual draws) and the bonus after n = cap all occurred.
    accepts, tries = spec.position_accepts.sum(0), spec.position_tries.sum(0)
    assert 0 < accepts[0] < tries[0] and 0 < accepts[1] < tries[1], (accepts, tries)
    assert tries[2:].sum() == 0  # at most 2 drafts verified: γ = 2, or the table's widest block (3 rows) of γ = 5
    if "sps" in how:  # at 2048 rows a whole second position pays for the wider block: every step ran at width 3
        assert spec.widths.tolist() == [0, spec.steps], spec.widths


@pytest.fixture(scope="module")
def planted_bugs():
    """`speculative_loop` with two planted bugs behind a traced switch (one compile for both; 0 = none):
    1 = a rejection draws C from p instead of norm(max(p − q, 0)); 2 = q without top-p (the drafts are still drawn
    from the drafter's nucleus, acceptance compares against the untruncated softmax). Returns (loop, accept,
    distribution): the jitted loop taking the switch first, and the patched module functions it traces through."""
    switch = {}
    real_accept, real_distribution = spec_module.accept, spec_module.distribution

    def accept_bug(target, draft, drafts, cap, key):
        n, bonus = real_accept(target, draft, drafts, cap, key)
        from_p = jax.random.categorical(jax.random.split(key)[1], jnp.log(target[jnp.arange(n.shape[0]), n]), axis=-1)
        return n, jnp.where(switch["bug"] == 1, from_p.astype(jnp.int32), bonus)

    def distribution_bug(logits, temperature, top_p):
        if logits.shape[1] == SMALL.dspark_block_size:  # the drafter's [B, γ, V] (the target's is [B, γ + 1, V])
            top_p = jnp.where(switch["bug"] == 2, 1.0, top_p)
        return real_distribution(logits, temperature, top_p)

    inner = spec_module.speculative_loop.__wrapped__

    def loop(bug, cfg, params, *traced, **static):
        switch["bug"] = bug
        return inner(cfg, params, *traced, **static)

    return jax.jit(loop, static_argnums=1, static_argnames=SPEC_STATIC), accept_bug, distribution_bug


# Observed with gamma=2, seed 2 (same draws as the correct run up to the bug): statistic / dof / p-value.
#   residual from p:  74.6/7/1.7e-13   68.7/7/2.7e-12   178.9/48/5.7e-17   169.2/53/4.6e-14
#   q without top-p:  92.2/7/4.4e-17   71.1/7/9.0e-13   210.5/48/3.1e-22   222.7/53/1.1e-22
@pytest.mark.parametrize("bug", [1, 2], ids=["residual_from_p", "q_without_top_p"])
def test_sampling_end_to_end_detects_planted_bugs(small_params, sampled_plain, planted_bugs, monkeypatch, bug):
    """The chi-square check above fails by a wide margin on two bugs that greedy decoding cannot see (with one-hot
    p and q both are exact): drawing a rejection's replacement from p, and accepting against the drafter's
    distribution without top-p while drafting from its nucleus."""
    loop, accept_bug, distribution_bug = planted_bugs
    monkeypatch.setattr(spec_module, "accept", accept_bug)
    monkeypatch.setattr(spec_module, "distribution", distribution_bug)
    monkeypatch.setattr(spec_module, "speculative_loop", lambda *args, **static: loop(jnp.int32(bug), *args, **static))
    spec = speculative_generate(SMALL, small_params, SAMPLED_PROMPT, max_new_tokens=SAMPLED_NEW, sampling=SAMPLED,
                                eos_id=None, gamma=2, seed=2)
    tests = _two_sample_chi_square(sampled_plain, spec.tokens)
    assert min(p for _, _, p in tests.values()) < 1e-8, tests
