"""Load smoke test: `bench.bench_load` closed and open loop against a router with real encoder + decode replicas
(in-process, real gRPC) — every request succeeds and the report is complete. The soak variant runs the real
processes (`deploy.launch.Cluster`) longer and is marked slow."""

from __future__ import annotations

import os

import pytest

from bench.bench_load import LoadConfig, format_table, run_load
from deploy.launch import Cluster, ClusterSpec


def test_load_smoke_closed_and_open_loop(e2e, tiny_checkpoint, fingerprints, loop_thread):
    async def scenario():
        encoder = await e2e.start_encoder(tiny_checkpoint)
        decode = router = None
        try:
            decode = await e2e.start_decode(tiny_checkpoint, fingerprints, [encoder.address])
            router = await e2e.start_router([f"127.0.0.1:{decode.port}"])
            config = LoadConfig(
                address=f"127.0.0.1:{router.port}",
                concurrency=(4,),
                rates=(8.0,),
                requests=30,
                max_tokens=6,
                deadline_s=30.0,
                duration_s=90.0,
                rss_interval_s=0.2,
                pids={"test-process": os.getpid()},
                measure_floor=False,
            )
            report = await run_load(config)
            return report, await e2e.wait_idle(decode)
        finally:
            if router is not None:
                await router.stop(0.5)
            if decode is not None:
                await decode.stop(0.5)
            await encoder.stop(0.5)

    report, idle = loop_thread.run(scenario(), timeout_s=180)
    closed, opened = report.levels
    for level in (closed, opened):
        assert (level.sent, level.ok, level.errors) == (30, 30, {}), level
        assert level.ttft_p50_s is not None and level.ttft_p99_s >= level.ttft_p50_s > 0
        assert level.itl_p50_s is not None and level.itl_p99_s >= level.itl_p50_s > 0
        assert level.throughput_tok_s > 0
    assert report.rss_series and closed.rss_peak_mib["test-process"] > 0
    assert "closed" in format_table(report.levels, report.floor)
    assert not any(idle.values()), idle


@pytest.mark.slow
def test_load_soak_on_real_processes(tiny_checkpoint, tmp_path):
    import asyncio

    small = ["--kv-budget-mb", "32", "--max-num-seqs", "16", "--max-batch-tokens", "512"]
    spec = ClusterSpec(
        checkpoint=tiny_checkpoint,
        encoders=2,
        decoders=2,
        redis="none",
        dtype="float32",
        extra_args={"decode": small},
        log_dir=str(tmp_path / "logs"),
    )
    with Cluster(spec) as cluster:
        pids = {p.name: p.popen.pid for p in cluster.processes() if p.popen is not None}
        config = LoadConfig(
            address=cluster.router_address,
            concurrency=(1, 4, 8),
            rates=(2.0, 8.0),
            requests=100,
            max_tokens=16,
            deadline_s=60.0,
            duration_s=240.0,
            pids=pids,
        )
        report = asyncio.run(run_load(config))
        assert not cluster.dead()
    for level in report.levels:
        assert level.errors == {} and level.ok == level.sent, level
    # No runaway memory over the soak: every process ends within 25% of its first sample (+64 MiB).
    first, last = report.rss_series[0][1], report.rss_series[-1][1]
    for name, rss in last.items():
        assert rss <= first.get(name, rss) * 1.25 + 64, (name, first.get(name), rss)
