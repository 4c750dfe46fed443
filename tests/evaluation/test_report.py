"""Verdicts from paired tests: every system speaks the same (text, seed), so the differences are
taken pair by pair; better / worse only when the paired test gives p below the significance level."""

import math

import pytest
from scipy import stats

from tts_lightning.evaluation.report import compare, comparisons, markdown_table, mean_sd, pace_error


def _old_unpaired_verdict(a, b):
    """The rule this replaced: |Δ mean| beyond two standard errors of the unpaired difference."""
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    return abs(ma - mb) > 2 * math.sqrt(sa**2 / len(a) + sb**2 / len(b))


def test_pairing_finds_a_small_steady_gain_the_unpaired_test_misses():
    # Texts differ a lot in how similar any system sounds; ours is steadily ~0.03 higher on each.
    theirs = [0.40, 0.75, 0.55, 0.90, 0.30, 0.65, 0.80, 0.45]
    ours = [t + d for t, d in zip(theirs, [0.03, 0.02, 0.04, 0.03, 0.02, 0.035, 0.025, 0.03], strict=True)]
    assert stats.ttest_ind(ours, theirs).pvalue > 0.5 and not _old_unpaired_verdict(ours, theirs)
    result = compare(ours, theirs, higher_is_better=True)
    assert result["verdict"] == "better" and result["test"] == "paired t" and result["pairs"] == 8
    assert result["p_value"] < 1e-4 and result["difference"] == pytest.approx(0.02875)
    assert compare(ours, theirs, higher_is_better=False)["verdict"] == "worse"  # e.g. pace error
    # The same differences in a shuffled order are no longer pairs: noise.
    shuffled = ours[1:] + ours[:1]
    assert compare(shuffled, theirs, higher_is_better=True)["verdict"] == "within noise"


def test_few_failures_are_not_significant_although_the_unpaired_rule_said_so():
    # 3 of 8 generations of ours ran past the limit, none of theirs: the old rule called it worse,
    # the exact McNemar test (3 discordant pairs, all one way: p = 2 / 2^3) does not.
    ours, theirs = [1, 1, 1, 0, 0, 0, 0, 0], [0] * 8
    assert _old_unpaired_verdict(ours, theirs)
    result = compare(ours, theirs, higher_is_better=False, binary=True)
    assert result["test"] == "exact McNemar" and result["p_value"] == pytest.approx(0.25)
    assert result["verdict"] == "within noise" and result["difference"] == pytest.approx(3 / 8)
    # 7 of 8 one way is: p = 2 / 2^7.
    seven = compare([1] * 7 + [0], [0] * 8, higher_is_better=False, binary=True)
    assert seven["p_value"] == pytest.approx(2 / 128) and seven["verdict"] == "worse"
    assert compare([1] * 7 + [0], [0] * 8, higher_is_better=False, binary=True, alpha=0.01)["verdict"] == (
        "within noise"
    )
    # Pairs that agree carry no evidence: both failing everywhere is no difference.
    assert compare([1] * 8, [1] * 8, higher_is_better=False, binary=True)["p_value"] == 1.0


def test_edge_cases():
    assert compare([], [], higher_is_better=True)["verdict"] == "n/a"
    assert compare([None, 0.5], [0.4, None], higher_is_better=True)["verdict"] == "n/a"  # no complete pair
    assert compare([0.0, 0.0], [0.0, 0.0], higher_is_better=False)["verdict"] == "within noise"
    assert compare([0.9], [0.1], higher_is_better=True)["verdict"] == "within noise"  # one pair
    same_gap = compare([0.5, 0.6, 0.7], [0.4, 0.5, 0.6], higher_is_better=True)  # sign test: 2 / 2^3
    assert (same_gap["p_value"], same_gap["verdict"]) == (0.25, "within noise")
    with pytest.raises(ValueError):
        compare([0.1], [0.1, 0.2], higher_is_better=True)
    m, sd = mean_sd([0.80, 0.81, 0.79, 0.80])
    assert m == pytest.approx(0.8) and sd == pytest.approx(math.sqrt(0.0002 / 3))


def _gen(text_index, seed, similarity, eos_failure=False):
    return {
        "text_index": text_index,
        "seed": seed,
        "similarity": similarity,
        "speaking_rate_ratio": 1.0,
        "eos_failure": eos_failure,
        "seconds": 1.0,
        "generation_seconds": 0.5,
    }


def test_comparisons_pair_by_text_and_seed_and_the_table_says_so():
    keys = [(t, s) for t in range(4) for s in (0, 1000)]
    base = [0.2, 0.8, 0.3, 0.7, 0.25, 0.75, 0.35, 0.65]
    ours = [_gen(t, s, b + 0.05 + 0.01 * (i % 3)) for i, ((t, s), b) in enumerate(zip(keys, base, strict=True))]
    theirs = [_gen(t, s, b, eos_failure=i < 3) for i, ((t, s), b) in enumerate(zip(keys, base, strict=True))]
    # Order must not matter (pairs are matched by text and seed); an unpaired extra is left out.
    systems = {"fine_tuned": ours, "zero_shot_xvector": theirs[::-1] + [_gen(9, 9, 0.0)]}
    comp = comparisons(systems)["zero_shot_xvector"]
    assert comp["speaker_similarity"]["pairs"] == 8 and comp["speaker_similarity"]["verdict"] == "better"
    assert comp["eos_failure_rate"]["verdict"] == "within noise" and comp["eos_failure_rate"]["p_value"] == 0.25
    assert comparisons(systems, alpha=1e-300)["zero_shot_xvector"]["speaker_similarity"]["verdict"] == "within noise"
    from tts_lightning.evaluation.report import summarize

    result = {
        "settings": {"alpha": 0.05},
        "speakers": {
            "alice": {
                "summary": {s: summarize(g) for s, g in systems.items()},
                "comparison": {"zero_shot_xvector": comp},
            }
        },
    }
    table = markdown_table(result)
    assert "| alice | speaker similarity |" in table and "better (p=" in table and "p < 0.05" in table


def test_pairs_without_spread_get_the_sign_test_not_p_0():
    """Two speakers' failure rates, 0 against 1 each: the t statistic is undefined (no spread) and
    two pairs cannot show a difference (sign test: p = 0.5); six pairs all one way can (p = 1/32)."""
    two = compare([0.0, 0.0], [1.0, 1.0], higher_is_better=False)
    assert (two["test"], two["p_value"], two["verdict"]) == ("sign (no spread)", 0.5, "within noise")
    six = compare([0.0] * 6, [1.0] * 6, higher_is_better=False)
    assert (six["p_value"], six["verdict"]) == (1 / 32, "better")
    assert compare([0.3, 0.3], [0.3, 0.3], higher_is_better=True)["p_value"] == 1.0
    rounding = compare([0.1 + 0.2] * 6, [0.3] * 6, higher_is_better=True)  # 5.6e-17 apart: no difference
    assert (rounding["difference"], rounding["p_value"], rounding["verdict"]) == (0.0, 1.0, "within noise")


def test_pace_error_is_symmetric_in_faster_and_slower():
    assert pace_error(1.0) == 0.0
    assert pace_error(1.25) == pytest.approx(pace_error(0.8))
    assert pace_error(None) is None and pace_error(0.0) is None
