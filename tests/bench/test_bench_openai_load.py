"""Slow: `bench.bench_openai_load` drives aiperf at three concurrency levels against a local cluster with the
OpenAI front (subprocesses, tiny checkpoint); every request completes with the requested output length, and
the report (markdown, JSON, PNG) is written. Skipped when aiperf (its own venv, see the bench) is absent."""

from __future__ import annotations

import json

import pytest

from bench.bench_openai_load import find_aiperf, main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def aiperf() -> str:
    path = find_aiperf()
    if path is None:
        pytest.skip("aiperf not installed: python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0")
    return path


def test_aiperf_load_report(aiperf, tmp_path):
    from tools.make_tiny_checkpoint import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", nvfp4=True, seed=0)
    out = tmp_path / "report"
    argv = ["--checkpoint", str(checkpoint), "--concurrency", "1,2,4", "--requests-per-stream", "3"]
    argv += ["--input-tokens", "32", "--output-tokens", "8", "--aiperf", aiperf, "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    levels = report["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2, 4]
    for lv in levels:
        assert lv["completed"] == lv["requests"] == 3 * lv["concurrency"] and lv["errors"] == 0, lv
        assert lv["output_tokens_avg"] == 8, lv  # ignore_eos + server-reported counts
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p99"], lv
        assert 0 < lv["itl_ms"]["p50"] <= lv["itl_ms"]["p99"], lv
    assert (out / "ttft_itl_vs_concurrency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ttft p50" in (out / "report.md").read_text()
