"""`bench.bench_mtp` on CPU at make-tiny shapes: every (B, D) figure is measured and consistent, and the synthetic
acceptor reproduces vLLM's cumulative per-position rates."""

from __future__ import annotations

import math

import pytest

from bench.bench_mtp import VLLM_RATES, expected_accepted, host_only, main, simulate_accepted


def test_tiny_cpu_run_reports_every_batch_and_depth(capsys) -> None:
    rows = main(["--device", "cpu", "--batches", "1", "3", "--ctx", "20", "--depths", "1", "3"])
    out = capsys.readouterr().out
    assert [(r.batch, r.depth) for r in rows] == [(1, 1), (1, 3), (3, 1), (3, 3)]
    for r in rows:
        assert r.verify_ms > 0 and r.chain_ms > 0 and r.plain_ms > 0 and r.floor_ms > 0
        assert r.rows == 1 + round(expected_accepted(r.depth))
        assert 1 <= r.tokens_per_round <= 1 + r.depth
        assert r.per_token_ms == pytest.approx((r.verify_ms + r.chain_ms) / r.tokens_per_round)
        assert r.plain_graph_ms is None and r.speedup == pytest.approx(r.plain_ms / r.per_token_ms)  # CPU: no graphs
        assert 0 < r.lm_plain_ms and 0 < r.lm_verify_ms
        assert r.full_depth_speedup(1.0) == pytest.approx(r.speedup)  # no scaling: the measured figure
        assert f"# B={r.batch} D={r.depth}: verify" in out
    assert "one-token byte floor" in out and "# B=3: best D=" in out and "at 42 layers" in out


def test_host_only_times_a_round_per_batch_and_depth(capsys) -> None:
    figures = host_only("cpu", [1, 3], 20, [3, 1], reps=3)
    out = capsys.readouterr().out
    assert set(figures) == {(1, 3), (1, 1), (3, 3), (3, 1)} and all(ms > 0 for ms in figures.values())
    assert "# host only: B=3 D=1 (2 rows/seq)" in out
    with pytest.raises(ValueError, match="--host-only"):
        host_only("cpu", [1], 0, [1], reps=1)


def test_synthetic_acceptor_follows_the_published_cumulative_rates() -> None:
    rounds, sequences = 4000, 8
    n = rounds * sequences
    mean = simulate_accepted(8, sequences, rounds, seed=1)
    sd = math.sqrt(
        sum(p * (1 - p) for p in VLLM_RATES)
        + 2
        * sum(  # accepted = sum of correlated indicators
            min(p, q) - p * q for i, p in enumerate(VLLM_RATES) for q in VLLM_RATES[i + 1 :]
        )
    )
    assert abs(mean - expected_accepted(8)) < 5 * sd / math.sqrt(n)
    assert expected_accepted(8) == pytest.approx(3.40, abs=0.005)  # vLLM's MTP8 accepted length 4.40 = 1 + 3.40
    assert simulate_accepted(1, sequences, rounds) == pytest.approx(VLLM_RATES[0], abs=5 * 0.43 / math.sqrt(n))


def test_bad_arguments_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--depths"):
        main(["--device", "cpu", "--depths", "9"])
    with pytest.raises(ValueError, match="--ctx"):
        main(["--device", "cpu", "--ctx", "0"])
