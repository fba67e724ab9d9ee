"""`bench.bench_structured` on CPU, a few steps: every batch is measured through the engine's own step (the
sampler's masks filled at sampling) and the table shows the raw fill next to the share."""

from __future__ import annotations

from bench.bench_structured import FILL_THREADS, VARIANTS, main


def test_cpu_run_reports_every_batch(capsys) -> None:
    rows = main(["--device", "cpu", "--batches", "1", "3", "--steps", "2"])
    out = capsys.readouterr().out
    assert [r.batch for r in rows] == [1, 3]
    for r in rows:
        assert r.forward_ms == 0.0  # a CPU forward is synchronous: nothing to hide the fill behind
        assert r.floor_ms > 0 and r.fill_ms > 0 and all(r.step_ms[name] > 0 for name in VARIANTS)
        assert r.share == r.structured_ms / r.floor_ms
        assert set(r.fill_by_threads) == {*map(str, FILL_THREADS), "auto"}
    assert "| host fill ms | fill hidden ms |" in out and "share of floor" in out
