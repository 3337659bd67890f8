"""Bootstrap intervals over prompts and Wilson intervals for shares (infer.stats)."""

import numpy as np
import pytest

from infer import stats


def test_mean_interval_covers_the_mean_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    small, large = rng.normal(3.0, 1.0, 16), rng.normal(3.0, 1.0, 1024)
    a, b = stats.mean_interval(small), stats.mean_interval(large)
    assert a.lo < a.value < a.hi and b.lo < b.value < b.hi and (a.n, b.n) == (16, 1024)
    assert (b.hi - b.lo) < (a.hi - a.lo) / 4  # √64 = 8× narrower in expectation
    # A normal mean's 95 % interval is ≈ ±1.96 σ/√n.
    assert (b.hi - b.lo) == pytest.approx(2 * 1.96 * large.std() / np.sqrt(1024), rel=0.1)
    assert stats.mean_interval([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0, 3, 0.95)


def test_mean_interval_covers_the_truth_at_its_level():
    """Over 300 experiments of 40 draws each, the 95 % interval holds the true mean about 95 % of the time."""
    rng = np.random.default_rng(1)
    hits = [(i := stats.mean_interval(rng.exponential(1.0, 40), resamples=500, seed=s)).lo <= 1.0 <= i.hi
            for s in range(300)]
    assert 0.88 <= np.mean(hits) <= 0.99


def test_ratio_interval_pools_counts_over_prompts():
    num = np.array([[1, 0], [3, 1], [2, 2], [0, 0]])
    den = np.array([[2, 1], [4, 3], [2, 2], [1, 0]])
    r = stats.ratio_interval(num, den, resamples=400)
    assert r[0].value == pytest.approx(6 / 9) and r[1].value == pytest.approx(3 / 6)
    assert all(x.lo <= x.value <= x.hi for x in r) and r[0].n == 4
    empty = stats.ratio_interval(np.zeros((3, 1)), np.zeros((3, 1)))[0]
    assert np.isnan(empty.value)


def test_proportion_interval_is_wilsons():
    """Newcombe (1998), Stat. Med. 17:857, table I, method 3 (Wilson score without continuity correction)."""
    for (k, n), (lo, hi) in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605), (0, 20): (0.0, 0.1611),
                             (1, 29): (0.0061, 0.1718)}.items():
        got = stats.proportion_interval(k, n)
        assert (got.value, got.n) == (k / n, n)
        assert (got.lo, got.hi) == (pytest.approx(lo, abs=1e-4), pytest.approx(hi, abs=1e-4))
    # Unlike a bootstrap, it keeps a width at a share of 1: 36 keys of 36 do not prove 100 %.
    assert stats.proportion_interval(36, 36).lo == pytest.approx(36 / (36 + 1.959964**2), abs=1e-6)


def test_prompt_intervals_count_prompts_and_keep_a_perfect_score_uncertain():
    """n is the number of prompts; keys retrieved by every prompt are a share of independent trials (Wilson: 10 of
    10 gives [0.72, 1]), not a bootstrap, which would claim [1, 1]."""
    out = stats.prompt_intervals({"exact": np.ones(10), "digits": np.r_[np.full(5, 0.2), np.full(5, 0.8)]},
                                 shares=("exact",))
    assert out["exact"]["n"] == out["digits"]["n"] == 10
    assert out["exact"]["value"] == out["exact"]["hi"] == 1.0 and 0.70 < out["exact"]["lo"] < 0.75
    assert out["digits"]["value"] == pytest.approx(0.5) and 0.2 < out["digits"]["lo"] < 0.5 < out["digits"]["hi"] < 0.8
    one_prompt = stats.prompt_intervals({"exact": np.ones(1), "digits": np.ones(1)}, shares=("exact",))
    assert one_prompt is None  # one prompt: no interval


def test_interval_text_reads_an_interval_or_its_stored_dict():
    iv = stats.Interval(0.0486, 0.00315, 0.112, 64)
    assert stats.interval_text(iv, ".3f") == stats.interval_text(iv.as_dict(digits=8), ".3f") == "0.049 [0.003, 0.112]"
    assert stats.interval_text(stats.Interval(-0.05, -0.2, 0.1, 3)) == "-0.05 [-0.20, 0.10]"
    assert stats.interval_text(stats.Interval(0.5, 0.25, 0.75, 3), "+.2f") == "+0.50 [+0.25, +0.75]"


def test_seed_interval_is_students_t():
    """Three runs 1, 2, 6: mean 3, s = √7, t(2) = 4.303 at 95 %: 3 ± 4.303·√7/√3 = [−3.572, 9.572]."""
    got = stats.seed_interval([1.0, 2.0, 6.0])
    assert (got.value, got.n) == (3.0, 3)
    assert (got.lo, got.hi) == (pytest.approx(-3.5724, abs=1e-3), pytest.approx(9.5724, abs=1e-3))
    # Many normal runs: close to ±1.96 σ/√n; two equal runs: no width.
    rng = np.random.default_rng(2)
    wide = stats.seed_interval(rng.normal(0.0, 1.0, 4000))
    assert wide.hi - wide.lo == pytest.approx(2 * 1.96 / np.sqrt(4000), rel=0.05)
    assert stats.seed_interval([0.5, 0.5])[:3] == (0.5, 0.5, 0.5)


@pytest.mark.parametrize("call, match", [
    (lambda: stats.seed_interval([1.0]), r"values.shape=\(1,\)"),
    (lambda: stats.seed_interval([1.0, 2.0], level=1.0), "level=1.0"),
    (lambda: stats.mean_interval([1.0]), "n=1"),
    (lambda: stats.mean_interval(np.ones((2, 2))), r"values.shape=\(2, 2\)"),
    (lambda: stats.mean_interval([1.0, 2.0], level=95), "level=95"),
    (lambda: stats.ratio_interval(np.ones((2, 3)), np.ones((2, 2))), "numerators.shape"),
    (lambda: stats.proportion_interval(5, 4), "successes=5, n=4"),
    (lambda: stats.proportion_interval(0, 0), "n=0"),
])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()
