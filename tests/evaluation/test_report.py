"""Verdicts from the spread: better / worse only beyond two standard errors of the difference."""

import math

import pytest

from tts_lightning.evaluation.report import compare, mean_sd, pace_error


def test_verdicts_follow_the_spread():
    tight_high, tight_low = [0.80, 0.81, 0.79, 0.80], [0.70, 0.71, 0.69, 0.70]
    assert compare(tight_high, tight_low, higher_is_better=True)["verdict"] == "better"
    assert compare(tight_low, tight_high, higher_is_better=True)["verdict"] == "worse"
    assert compare(tight_high, tight_low, higher_is_better=False)["verdict"] == "worse"  # e.g. failures
    noisy = [0.5, 1.1, 0.6, 1.0]  # same mean difference, much larger spread
    result = compare(noisy, [v - 0.1 for v in [0.9, 0.7, 0.4, 1.2]], higher_is_better=True)
    assert result["verdict"] == "within noise" and result["difference"] == pytest.approx(0.1)
    m, sd = mean_sd(tight_high)
    assert m == pytest.approx(0.8) and sd == pytest.approx(math.sqrt(0.0002 / 3))
    assert compare([], [1.0], higher_is_better=True)["verdict"] == "n/a"
    assert compare([0.0, 0.0], [0.0, 0.0], higher_is_better=False)["verdict"] == "within noise"


def test_pace_error_is_symmetric_in_faster_and_slower():
    assert pace_error(1.0) == 0.0
    assert pace_error(1.25) == pytest.approx(pace_error(0.8))
    assert pace_error(None) is None and pace_error(0.0) is None
