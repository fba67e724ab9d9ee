"""Machine ceilings measured in the same run as a benchmark, and the timing helpers the benchmarks share.

``measure_ceilings`` times a large device-to-device copy (bytes read + written over time) and a large bf16
``torch.matmul`` on random data; every benchmark divides its byte count by that bandwidth to get its floor.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    copy_gbs: float  # GB/s, bytes read + written
    bf16_tflops: float
    device: str

    def floor_us(self, n_bytes: float) -> float:
        return n_bytes / (self.copy_gbs * 1e9) * 1e6

    def line(self) -> str:
        return (
            f"# device {self.device}: measured copy bandwidth {self.copy_gbs:.0f} GB/s, "
            f"bf16 matmul {self.bf16_tflops:.0f} TFLOP/s"
        )


def time_graph_ms(fn: Callable[[], object], reps: int = 50, warmup: int = 3) -> float:
    """Median time of one replay of a CUDA graph holding ``fn`` (CUDA events around each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def time_eager_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 2) -> float:
    """Median wall time of ``fn`` between CUDA events (includes launch overhead and host syncs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_host_ms(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn`` on the host clock (CPU benchmarks)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_ms(fn: Callable[[], object], device: str, reps: int = 20, warmup: int = 2) -> float:
    """``time_eager_ms`` on a CUDA device, ``time_host_ms`` elsewhere."""
    timer = time_eager_ms if str(device).startswith("cuda") else time_host_ms
    return timer(fn, reps=reps, warmup=warmup)


def _copy_gbs(n_bytes: int) -> float:
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * n_bytes / (time_eager_ms(lambda: dst.copy_(src), reps=10) * 1e-3) / 1e9


def _matmul_tflops(n: int) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / (time_eager_ms(lambda: torch.matmul(a, b), reps=10, warmup=3) * 1e-3) / 1e12


def measure_ceilings(copy_bytes: int = 4 << 30, mm: int = 8192) -> Ceilings:
    copy_gbs = _copy_gbs(copy_bytes)
    tflops = _matmul_tflops(mm)
    torch.cuda.empty_cache()
    return Ceilings(copy_gbs=copy_gbs, bf16_tflops=tflops, device=torch.cuda.get_device_name())


def count_launches(fn: Callable[[], object]) -> tuple[int, int, float, list[tuple[str, int, float]]]:
    """(kernels, memcpy/memset, ms the GPU spent in them, [(kernel, launches, us)] by time) during one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(1 for e in events if e.name.startswith(("Memcpy", "Memset")))
    busy_ms = sum(e.time_range.elapsed_us() for e in events) / 1e3
    by_name: dict[str, tuple[int, float]] = {}
    for e in events:
        n, us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, us + e.time_range.elapsed_us())
    top = sorted(((name, n, us) for name, (n, us) in by_name.items()), key=lambda row: -row[2])
    return len(events) - copies, copies, busy_ms, top


def expected_experts(experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` tokens touch in one MoE layer when each picks `top_k` of `experts` uniformly:
    E (1 - (1 - k/E)^rows)."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))


if __name__ == "__main__":
    print(measure_ceilings().line())
