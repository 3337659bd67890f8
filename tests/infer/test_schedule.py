"""infer.schedule: survival, the verify-length scheduler against hand cases and a brute-force reference,
compile once, and the SpsTable file format and its errors. No model: every input is a small array.

The brute-force reference enumerates every K, builds the top-K set explicitly and counts each row's
share; its mutants (ties → larger K, ties spread over rows, one cost for every width) must each
disagree with `schedule` somewhere on the same inputs, so the comparison can fail.
"""

import json

import numpy as np
import pytest

from infer.schedule import MEASURE, SpsTable, schedule, survival

WIDTHS = (1, 2, 3, 4)
FALLING = np.array([10.0, 9.0, 8.0, 5.0], np.float32)  # steps/s at widths 1, 2, 3, 4


def run(confidence, active, sps, widths, sampled=False):
    lengths, index, tau = schedule(np.asarray(confidence, np.float32), np.asarray(active, bool),
                                   np.asarray(sps, np.float32), widths, sampled)
    return np.asarray(lengths), int(index), float(tau)


def reference(confidence, active, sps, widths, ties="smaller", order="row", cost="width"):
    """Plain enumeration over K, float64. Mutants: ties="larger", order="position" (equal survivals
    spread over rows), cost="widest" (every K priced at the widest width)."""
    b, gamma = confidence.shape
    s = np.cumprod(confidence.astype(np.float64), axis=1)
    entries = [(-s[i, k], i, k) if order == "row" else (-s[i, k], k, i)
               for i in range(b) if active[i] for k in range(gamma)]
    entries.sort()
    best = None
    for top in range(len(entries) + 1):
        counts = np.zeros(b, np.int64)
        for entry in entries[:top]:
            counts[entry[1] if order == "row" else entry[2]] += 1
        fitting = [j for j, w in enumerate(widths) if w >= 1 + counts.max()]
        if not fitting:
            continue
        j = fitting[0]
        tau = active.sum() + sum(-entry[0] for entry in entries[:top])
        gain = tau * sps[len(widths) - 1 if cost == "widest" else j]
        if best is None or gain > best[0] or (ties == "larger" and gain == best[0]):
            best = (gain, 1 + counts, j, tau)
    return best[1:]


def by_position(confidence, active, sps, widths):
    """The sampling rule, float64, written out: for m = 1 … γ, the rows at length m ranked by s_m (ties by row),
    every count r of them tried, the first best τ·SPS kept; stop at the first m that adds none."""
    b, gamma = confidence.shape
    s = np.cumprod(confidence.astype(np.float64), axis=1)
    lengths, tau, j = np.ones(b, np.int64), float(active.sum()), 0
    for m in range(1, gamma + 1):
        rows = sorted((i for i in range(b) if active[i] and lengths[i] == m), key=lambda i: (-s[i, m - 1], i))
        best = (tau * sps[j], 0, j)
        need = next((k for k, w in enumerate(widths) if w >= 1 + m), None)
        for r in range(1, len(rows) + 1):
            if need is None:
                break
            wider = max(j, need)
            gain = (tau + sum(s[i, m - 1] for i in rows[:r])) * sps[wider]
            if gain > best[0]:
                best = (gain, r, wider)
        if best[1] == 0:
            break
        lengths[rows[:best[1]]] += 1
        tau += sum(s[i, m - 1] for i in rows[:best[1]])
        j = best[2]
    return lengths, j, tau


# ---------------------------------------------------------------------------------------------
# survival and hand cases

def test_survival_is_the_running_product():
    s = survival(np.array([[0.9, 0.5, 0.2], [1.0, 0.0, 0.7]], np.float32))
    assert s.dtype == np.float32
    np.testing.assert_allclose(s, [[0.9, 0.45, 0.09], [1.0, 0.0, 0.0]], rtol=1e-6)


def test_falling_sps_stops_before_everything():
    # survivals [.9 .81 .729] and [.5 .05 .005]; ranked: r0 r0 r0 r1 r1 r1.
    # K: 0 → 2·10 = 20; 1 → 2.9·9 = 26.1; 2 → 3.71·8 = 29.68; 3 → 4.439·5; … 6 → 4.994·5 = 24.97.
    lengths, index, tau = run([[0.9, 0.9, 0.9], [0.5, 0.1, 0.1]], [True, True], FALLING, WIDTHS)
    np.testing.assert_array_equal(lengths, [3, 1])
    assert WIDTHS[index] == 3
    assert tau == pytest.approx(3.71, rel=1e-6)


def test_flat_sps_takes_every_positive_survival():
    # survivals [.9 0 0] and [.5 .25 .125]: zero survivals add nothing, so ties → smaller K leave them out.
    lengths, index, tau = run([[0.9, 0.0, 0.9], [0.5, 0.5, 0.5]], [True, True], np.full(4, 5.0), WIDTHS)
    np.testing.assert_array_equal(lengths, [2, 4])
    assert WIDTHS[index] == 4
    assert tau == pytest.approx(2 + 0.9 + 0.5 + 0.25 + 0.125, rel=1e-6)


def test_inactive_rows_get_length_one_and_count_nothing():
    confidence = [[0.9, 0.9, 0.9], [0.99, 0.99, 0.99], [0.5, 0.1, 0.1]]
    lengths, index, tau = run(confidence, [True, False, True], FALLING, WIDTHS)
    np.testing.assert_array_equal(lengths, [3, 1, 1])  # as without the middle row
    assert (WIDTHS[index], tau) == (3, pytest.approx(3.71, rel=1e-6))
    lengths, index, tau = run(confidence, [False] * 3, FALLING, WIDTHS)
    np.testing.assert_array_equal(lengths, [1, 1, 1])
    assert (index, tau) == (0, 0.0)


def test_fixed_gamma_verifies_every_draft():
    confidence = [[0.3, 0.2, 0.1], [0.9, 0.8, 0.7]]
    lengths, index, _ = run(confidence, [True, True], [7.0], (4,))
    np.testing.assert_array_equal(lengths, [4, 4])
    assert index == 0
    lengths, _, _ = run([[0.3, 0.0, 0.1], [0.9, 0.8, 0.7]], [True, True], [7.0], (4,))
    np.testing.assert_array_equal(lengths, [2, 4])  # up to the first zero confidence


def test_too_wide_candidates_are_excluded():
    # Only K with max_i k_i ≤ 1 fit width 2; the top 2 are both row 0's, so K* = 1.
    lengths, index, tau = run([[0.9, 0.9, 0.9], [0.5, 0.1, 0.1]], [True, True], [5.0, 5.0], (1, 2))
    np.testing.assert_array_equal(lengths, [2, 1])
    assert (index, tau) == (1, pytest.approx(2.9, rel=1e-6))


def test_equal_survivals_rank_row_major():
    # Four survivals of .5: the top 2 are row 0's (width 3 at 1 step/s), not one per row (width 2).
    lengths, _, _ = run([[0.5, 1.0], [0.5, 1.0]], [True, True], [3.0, 2.5, 1.0], (1, 2, 3))
    np.testing.assert_array_equal(lengths, [2, 1])  # K=1: 2.5·2.5 beats 2·3 and 3·1


# ---------------------------------------------------------------------------------------------
# brute force

def dyadic_trials(rng, n, b, gamma, widths):
    """Confidences in {0, ¼, ½, ¾, 1} and integer steps/s: every τ·SPS is exact in float32, so ties are
    real ties and the comparison is exact."""
    for _ in range(n):
        confidence = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(b, gamma), p=[0.1, 0.15, 0.2, 0.25, 0.3])
        yield confidence, rng.random(b) < 0.8, rng.integers(1, 21, len(widths)).astype(np.float64)


@pytest.mark.parametrize("widths", [(1, 2, 3, 5), (2, 4)])
def test_matches_brute_force_exactly_with_ties(widths):
    rng = np.random.default_rng(0)
    mutants = dict(larger=dict(ties="larger"), spread=dict(order="position"), widest=dict(cost="widest"))
    caught = dict.fromkeys(mutants, False)
    for confidence, active, sps in dyadic_trials(rng, 150, 3, 4, widths):
        lengths, index, tau = run(confidence, active, sps, widths)
        want = reference(confidence, active, sps, widths)
        np.testing.assert_array_equal(lengths, want[0])
        assert (index, tau) == (want[1], want[2])
        assert lengths.max() <= widths[index]
        for name, kw in mutants.items():
            got = reference(confidence, active, sps, widths, **kw)
            caught[name] |= not (np.array_equal(got[0], lengths) and got[1] == index)
    assert all(caught.values()), caught


@pytest.mark.parametrize("widths", [(1, 2, 3, 5), (2, 4)])
def test_sampling_rule_matches_its_written_out_form(widths):
    rng = np.random.default_rng(3)
    differ = 0
    for confidence, active, sps in dyadic_trials(rng, 150, 3, 4, widths):
        lengths, index, tau = run(confidence, active, sps, widths, sampled=True)
        want = by_position(confidence, active, sps, widths)
        np.testing.assert_array_equal(lengths, want[0])
        assert (index, tau) == (want[1], want[2])
        assert lengths.max() <= widths[index]
        differ += not np.array_equal(lengths, reference(confidence, active, sps, widths)[0])
    assert differ, "the sampling rule never differed from the argmax: the comparison cannot fail"


def test_sampling_rule_widens_for_a_whole_position_at_large_batch():
    """64 rows, widths (2, 3) at 30 / 27 steps/s: no single second draft pays for the wider block, a whole position
    does; the sampling rule takes it, as the argmax does."""
    confidence = np.full((64, 2), 0.75, np.float32)
    for sampled in (True, False):
        lengths, index, _ = run(confidence, np.ones(64, bool), [30.0, 27.0], (2, 3), sampled)
        assert index == 1 and np.all(lengths == 3), (sampled, lengths)


def _first_two_tokens(sampled: bool, trials: int) -> tuple[np.ndarray, np.ndarray]:
    """Speculative sampling at batch 1 through the real `schedule` and `accept`, vectorised over `trials`
    independent runs of two steps: the first two emitted tokens [trials, 2] and the verify lengths [2 · trials].
    Target p and draft q are fixed distributions over 4 tokens; the drafter's confidence c_k reads the
    previous token x_{k−1} (as DSpark's does through W1[x_{k−1}]), 0.3 after token 0, else 0.98."""
    import jax
    import jax.numpy as jnp

    from infer.speculative import accept

    v, gamma, widths, sps = 4, 3, (2, 4), jnp.array([1.0, 0.7])
    p, q, c = P_TARGET, jnp.array([0.1, 0.2, 0.3, 0.4]), jnp.array([0.3, 0.98, 0.98, 0.98])
    lengths_of = jax.vmap(lambda conf: schedule(conf[None], jnp.ones(1, bool), sps, widths, sampled).lengths[0])
    key, rows = jax.random.PRNGKey(0), jnp.arange(trials)
    anchor, count = jnp.zeros(trials, jnp.int32), jnp.zeros(trials, jnp.int32)
    out, used = jnp.zeros((trials, 2), jnp.int32), []
    for _ in range(2):
        key, k_draft, k_accept = jax.random.split(key, 3)
        drafts = jax.random.categorical(k_draft, jnp.log(q), shape=(trials, gamma)).astype(jnp.int32)
        lengths = lengths_of(c[jnp.concatenate([anchor[:, None], drafts[:, :-1]], axis=1)])
        used.append(lengths)
        n, bonus = accept(jnp.broadcast_to(p, (trials, gamma + 1, v)), jnp.broadcast_to(q, (trials, gamma, v)),
                          drafts, lengths - 1, k_accept)
        emitted = jnp.where(jnp.arange(gamma + 1) < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
        for i in range(gamma + 1):
            col = jnp.minimum(count + i, 1)
            out = out.at[rows, col].set(jnp.where((i <= n) & (count + i < 2), emitted[:, i], out[rows, col]))
        anchor, count = bonus, count + n + 1
    return np.asarray(out), np.concatenate(used)


P_TARGET = np.array([0.4, 0.3, 0.2, 0.1])


def test_sampling_stays_exact_when_confidences_read_the_previous_draft():
    """With widths (2, 4) at batch 1, the argmax verifies draft 2 depending on c_3, i.e. on draft 2 itself, and
    the second token drifts from p (p-value ~1e-80 at 100 000 trials); the sampling rule keeps both tokens on p
    while still verifying three drafts in a good share of steps."""
    from scipy import stats

    trials = 100_000
    for sampled in (True, False):
        tokens, lengths = _first_two_tokens(sampled, trials)
        pvalues = [stats.chisquare(np.bincount(tokens[:, j], minlength=4), P_TARGET * trials).pvalue for j in (0, 1)]
        if sampled:
            assert min(pvalues) > 1e-3, pvalues
            assert 0.2 < np.mean(lengths == 4) < 0.8, np.mean(lengths == 4)  # both widths in use
        else:
            assert pvalues[1] < 1e-12, pvalues  # the argmax is the planted mutant


def test_matches_brute_force_on_continuous_confidences():
    rng = np.random.default_rng(1)
    widths = (1, 2, 4)
    for _ in range(150):
        confidence = rng.random((4, 3)) ** 0.3
        active, sps = rng.random(4) < 0.8, np.sort(rng.uniform(1, 10, 3))[::-1]
        lengths, index, tau = run(confidence, active, sps, widths)
        want = reference(confidence, active, sps, widths)
        np.testing.assert_array_equal(lengths, want[0])  # no float32 near-ties at this seed
        assert (index, tau) == (want[1], pytest.approx(want[2], rel=1e-6))


def test_compiles_once_for_new_values():
    rng = np.random.default_rng(2)
    widths = (1, 3, 6)
    run(rng.random((5, 5)), rng.random(5) < 0.5, [9.0, 7.0, 3.0], widths)
    compiled = schedule._cache_size()
    for _ in range(3):
        run(rng.random((5, 5)), rng.random(5) < 0.5, rng.uniform(1, 9, 3), widths)
    assert schedule._cache_size() == compiled


@pytest.mark.parametrize("confidence, active, sps, widths, match", [
    (np.ones(3), np.ones(3, bool), np.ones(1), (1,), "confidence.shape"),
    (np.ones((2, 3)), np.ones(3, bool), np.ones(1), (1,), "active"),
    (np.ones((2, 3)), np.ones(2, np.int32), np.ones(1), (1,), "active"),
    (np.ones((2, 3)), np.ones(2, bool), np.ones(2), (1, 5), "γ\\+1=4"),
    (np.ones((2, 3)), np.ones(2, bool), np.ones(2), (2, 1), "strictly increasing"),
    (np.ones((2, 3)), np.ones(2, bool), np.ones(3), (1, 2), "sps.shape"),
])
def test_schedule_rejects_bad_shapes_and_widths(confidence, active, sps, widths, match):
    with pytest.raises(ValueError, match=match):
        schedule(confidence.astype(np.float32), active, sps.astype(np.float32), widths)


# ---------------------------------------------------------------------------------------------
# SpsTable

def table(**changes):
    fields = dict(widths=(1, 2, 4), steps_per_s={1: (100.0, 90.0, 70.0), 8: (50.0, 45.0, 30.0)},
                  meta={"preset": "mini", "config": "cfg-abc123", "machine": "cpu", "date": "2025-01-01"})
    return SpsTable(**{**fields, **changes})


def test_table_round_trip(tmp_path):
    path = tmp_path / "sps.json"
    table().save(path)
    loaded = SpsTable.load(path)
    assert loaded == table()
    row = loaded.row(8)
    assert row.dtype == np.float32
    np.testing.assert_array_equal(row, [50.0, 45.0, 30.0])
    loaded.check("cfg-abc123")


def test_table_row_names_the_missing_batch_and_the_fix():
    with pytest.raises(ValueError, match=r"batch size 4 \(it has \[1, 8\]\).*infer.bench_spec --measure-sps"):
        table().row(4)
    assert "--measure-sps" in MEASURE


@pytest.mark.parametrize("changes, match", [
    (dict(widths=(2, 1, 4)), "SpsTable.widths"),
    (dict(widths=(1, 1, 4)), "SpsTable.widths"),
    (dict(widths=(0, 2, 4)), "SpsTable.widths"),
    (dict(widths=[1, 2, 4]), "SpsTable.widths"),
    (dict(steps_per_s={1: (100.0, 90.0)}), r"steps_per_s\[1\]"),
    (dict(steps_per_s={1: (100.0, float("nan"), 70.0)}), r"steps_per_s\[1\].*finite positive"),
    (dict(steps_per_s={1: (100.0, float("inf"), 70.0)}), r"steps_per_s\[1\]"),
    (dict(steps_per_s={1: (100.0, 0.0, 70.0)}), r"steps_per_s\[1\]"),
    (dict(steps_per_s={0: (100.0, 90.0, 70.0)}), "batch size"),
    (dict(steps_per_s={}), "non-empty"),
    (dict(meta={"date": object()}), "meta"),
])
def test_table_rejects_bad_fields(changes, match):
    with pytest.raises(ValueError, match=match):
        table(**changes)


def test_table_check_refuses_another_config():
    with pytest.raises(ValueError, match="measured for another config.*cfg-other.*--measure-sps"):
        table().check("cfg-other")
    with pytest.raises(ValueError, match="None"):
        table(meta={}).check("cfg-abc123")


@pytest.mark.parametrize("text", [
    "not json at all",
    json.dumps([1, 2, 3]),
    json.dumps({"widths": [1], "steps_per_s": {"1": [5.0]}}),
    json.dumps({"widths": [1], "steps_per_s": {"one": [5.0]}, "meta": {}}),
    '{"widths": [1], "steps_per_s": {"1": [NaN]}, "meta": {}}',
])
def test_load_refuses_a_file_that_is_not_a_table(tmp_path, text):
    path = tmp_path / "bogus.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{path}: not an SpsTable"):
        SpsTable.load(path)
