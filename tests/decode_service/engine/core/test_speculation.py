"""`--mtp-depth auto`'s chooser on synthetic step costs (no model): the depth with the most expected tokens per
millisecond per batch bucket, D = 0 when drafting does not pay, and batches mapped to their bucket."""

from __future__ import annotations

import pytest

from decode_service.engine.core.speculation import DepthTable, StepCosts, best_depth, expected_tokens

RATES = (0.8, 0.6, 0.4, 0.2)


def test_expected_tokens_are_the_bonus_plus_the_cumulative_rates():
    assert expected_tokens(0, RATES) == 1.0
    assert expected_tokens(2, RATES) == pytest.approx(2.4)
    assert expected_tokens(9, RATES) == pytest.approx(3.0)  # positions past the table accept nothing


def test_lm_head_bound_batch_one_takes_fewer_depths_than_a_large_batch():
    # B=1: each depth re-reads the lm_head (1 ms a depth) against a 2 ms step; tokens/ms:
    # D=0 0.5, D=1 1.8/3.1=0.58, D=2 2.4/4.2=0.571, D=3 2.8/5.3=0.53 -> D=1.
    one = StepCosts(plain=2.0, verify=(2.1, 2.2, 2.3, 2.4), chain=(1.0, 2.0, 3.0, 4.0))
    # B=64: the step is 10 ms, a depth 1 ms: D=2 2.4/14=0.171, D=3 2.8/16=0.175, D=4 3.0/18=0.167 -> D=3.
    many = StepCosts(plain=10.0, verify=(11.0, 12.0, 13.0, 14.0), chain=(1.0, 2.0, 3.0, 4.0))
    assert best_depth(one, RATES) == 1
    assert best_depth(many, RATES) == 3
    table = DepthTable.choose({64: many, 1: one, 8: many}, RATES)
    assert table.buckets == (1, 8, 64) and table.depths == (1, 3, 3)
    assert [table.depth_for(b) for b in (1, 2, 8, 9, 64, 100)] == [1, 3, 3, 3, 3, 3]
    lines = table.lines()
    assert len(lines) == 3 and lines[0].startswith("B<=1: D=1 ") and "x tokens/s" in lines[0]


def test_no_speculation_when_drafting_never_pays():
    costly = StepCosts(plain=1.0, verify=(2.0, 3.0), chain=(2.0, 4.0))
    assert best_depth(costly, RATES) == 0
    assert DepthTable.choose({4: costly}, RATES).depth_for(3) == 0


def test_depths_are_capped_by_the_measured_depths_and_the_rate_table():
    free = StepCosts(plain=1.0, verify=(1.0,) * 6, chain=(0.0,) * 6)  # drafting costs nothing: the deepest pays
    assert best_depth(free, RATES) == 4  # the table covers 4 positions
    assert best_depth(StepCosts(1.0, (1.0, 1.0), (0.0, 0.0)), RATES) == 2  # 2 depths measured
