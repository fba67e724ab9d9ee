"""Load benchmark of the whole service: closed-loop and open-loop (Poisson) clients against a router.

    python -m bench.bench_load --address 127.0.0.1:50050 --concurrency 1,4,8 --rates 2,4 --requests 40
    python -m bench.bench_load --checkpoint artifacts/tiny --encoders 2 --decoders 2   # starts a local cluster

Closed loop: C clients, each sends its next request when the previous one ends. Open loop: requests arrive as
a Poisson process of rate R (seeded), whatever the state of the earlier ones (at most `--max-outstanding` in
flight; later arrivals wait for a slot and that wait counts in their latency). Every request is a chat from a
mix of text, image, audio and image+audio prompts with distinct media (no cache hits across requests), greedy,
a fixed number of output tokens.

Per level it prints goodput (requests/s that succeeded within the SLO: TTFT <= --slo-ttft-s and mean ITL <=
--slo-itl-s), throughput, TTFT and ITL p50/p99, errors by status code, and the RSS of the cluster processes
(sampled every --rss-interval-s; with --address, pass --pids to watch processes you started). The reference
("floor") column is the unloaded TTFT / ITL of one request at a time, measured first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import grpc

from common.auth import aio_channel
from common.grpc_util import channel_options
from common.settings import SecuritySettings, add_security_args, security_settings
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc, media_pb2
from tools.make_sample_media import draw_shapes, png_bytes, sample_media

MIXES = ("text", "image", "audio", "image+audio")


# ---------------------------------------------------------------------------------------------------------
# Requests and their measurements


def _image(variant: int) -> bytes:
    image = draw_shapes(96, 64)
    for k in range(4):  # the variant's bytes in the top-left pixels: distinct content, distinct mm_key
        image.putpixel((k, 0), ((variant >> (8 * k)) & 255, 17, 0))
    return png_bytes(image)


def build_request(request_id: str, kind: str, variant: int, max_tokens: int, audio: bytes) -> pb.GenerateRequest:
    parts = []
    if "image" in kind:
        parts.append(pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=_image(variant))))
    if "audio" in kind:
        parts.append(pb.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=audio)))
    parts.append(pb.ContentPart(text=f"Request {variant}: describe what you get in one sentence."))
    return pb.GenerateRequest(
        request_id=request_id,
        chat=pb.ChatPrompt(messages=[pb.Message(role=pb.ROLE_USER, content=parts)], reasoning_effort=0.0),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


@dataclass
class Sample:
    status: str  # "OK" or a status code name
    latency_s: float
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    tokens: int = 0


async def one_request(stub: generator_pb2_grpc.GeneratorStub, request: pb.GenerateRequest, deadline_s: float) -> Sample:
    started = time.monotonic()
    last: float | None = None
    sample = Sample("OK", 0.0)
    finals = 0
    try:
        async for message in stub.Generate(request, timeout=deadline_s):
            if message.HasField("final"):
                finals += 1
                continue
            if not message.delta.token_ids:
                continue
            now = time.monotonic()
            if sample.ttft_s is None:
                sample.ttft_s = now - started
            elif last is not None:
                sample.itls_s.append(now - last)
            last = now
            sample.tokens += len(message.delta.token_ids)
        if finals != 1:
            sample.status = "BAD_STREAM"
    except grpc.aio.AioRpcError as exc:
        sample.status = exc.code().name
    sample.latency_s = time.monotonic() - started
    return sample


class Requests:
    """Deterministic stream of mixed requests with distinct media."""

    def __init__(self, mix: Sequence[str], max_tokens: int, seed: int) -> None:
        self.mix, self.max_tokens = tuple(mix), max_tokens
        self.audio = sample_media()["tones_16k.wav"]
        self.rng = random.Random(seed)
        self.count = 0
        self.base = seed * 1_000_003

    def next(self, tag: str) -> pb.GenerateRequest:
        kind = self.mix[self.count % len(self.mix)]
        self.count += 1
        return build_request(f"load-{tag}-{self.count}", kind, self.base + self.count, self.max_tokens, self.audio)


async def closed_loop(
    stub, requests: Requests, concurrency: int, total: int, deadline_s: float, duration_s: float
) -> list[Sample]:
    samples: list[Sample] = []
    issued = 0
    stop_at = time.monotonic() + duration_s

    async def client() -> None:
        nonlocal issued
        while issued < total and time.monotonic() < stop_at:
            issued += 1
            samples.append(await one_request(stub, requests.next(f"c{concurrency}"), deadline_s))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples


async def open_loop(
    stub,
    requests: Requests,
    rate: float,
    total: int,
    deadline_s: float,
    duration_s: float,
    max_outstanding: int,
    rng: random.Random,
) -> list[Sample]:
    slots = asyncio.Semaphore(max_outstanding)
    tasks: list[asyncio.Task] = []
    stop_at = time.monotonic() + duration_s

    async def launch(request: pb.GenerateRequest, arrived: float) -> Sample:
        async with slots:
            sample = await one_request(stub, request, deadline_s)
        sample.latency_s = time.monotonic() - arrived  # includes the wait for a slot
        return sample

    for _ in range(total):
        if time.monotonic() >= stop_at:
            break
        tasks.append(asyncio.create_task(launch(requests.next(f"r{rate:g}"), time.monotonic())))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------------------------------------------------
# Memory


class RssSampler:
    """Samples VmRSS (MiB) of named processes from /proc every `interval_s` on a daemon thread."""

    def __init__(self, pids: dict[str, int], interval_s: float) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.series: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = time.monotonic()

    @staticmethod
    def rss_mib(pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024.0
        except OSError:
            return None
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            reading = {name: rss for name, pid in self.pids.items() if (rss := self.rss_mib(pid)) is not None}
            self.series.append((round(time.monotonic() - self._t0, 2), reading))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        if self.pids:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def peak_since(self, t: float) -> dict[str, float]:
        peak: dict[str, float] = {}
        for when, reading in self.series:
            if when >= t:
                for name, rss in reading.items():
                    peak[name] = max(peak.get(name, 0.0), rss)
        return peak

    def now(self) -> float:
        return time.monotonic() - self._t0


# ---------------------------------------------------------------------------------------------------------
# Summary


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@dataclass
class LevelResult:
    mode: str  # "closed" or "open"
    level: float  # concurrency or rate (req/s)
    sent: int
    ok: int
    errors: dict[str, int]
    wall_s: float
    goodput_rps: float
    throughput_tok_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    latency_p99_s: float | None
    rss_peak_mib: dict[str, float]


def summarize(
    mode: str,
    level: float,
    samples: list[Sample],
    wall_s: float,
    slo_ttft_s: float,
    slo_itl_s: float,
    rss_peak: dict[str, float],
) -> LevelResult:
    ok = [s for s in samples if s.status == "OK"]
    errors: dict[str, int] = {}
    for s in samples:
        if s.status != "OK":
            errors[s.status] = errors.get(s.status, 0) + 1
    good = [
        s
        for s in ok
        if s.ttft_s is not None
        and s.ttft_s <= slo_ttft_s
        and (not s.itls_s or sum(s.itls_s) / len(s.itls_s) <= slo_itl_s)
    ]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    itls = [x for s in ok for x in s.itls_s]
    wall = max(wall_s, 1e-9)
    return LevelResult(
        mode,
        level,
        len(samples),
        len(ok),
        errors,
        wall_s,
        len(good) / wall,
        sum(s.tokens for s in ok) / wall,
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(itls, 50),
        percentile(itls, 99),
        percentile([s.latency_s for s in samples], 99),
        rss_peak,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_table(results: Sequence[LevelResult], floor: LevelResult | None) -> str:
    header = (
        f"{'mode':<7}{'level':>7}{'sent':>6}{'ok':>5}{'err':>5}{'goodput/s':>10}{'tok/s':>9}"
        f"{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'TTFT/floor':>11}  rss peak MiB"
    )
    lines = [header, "-" * len(header)]
    for r in ([floor] if floor else []) + list(results):
        ratio = f"{r.ttft_p50_s / floor.ttft_p50_s:.2f}x" if floor and floor.ttft_p50_s and r.ttft_p50_s else "-"
        rss = " ".join(f"{k}={v:.0f}" for k, v in sorted(r.rss_peak_mib.items())) or "-"
        lines.append(
            f"{r.mode:<7}{r.level:>7g}{r.sent:>6}{r.ok:>5}{sum(r.errors.values()):>5}"
            f"{r.goodput_rps:>10.2f}{r.throughput_tok_s:>9.1f}{_ms(r.ttft_p50_s):>10}{_ms(r.ttft_p99_s):>8}"
            f"{_ms(r.itl_p50_s):>9}{_ms(r.itl_p99_s):>8}{ratio:>11}  {rss}"
        )
    for r in results:
        if r.errors:
            lines.append(f"errors at {r.mode} {r.level:g}: {r.errors}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Driver


@dataclass
class LoadConfig:
    address: str
    concurrency: tuple[int, ...] = (1, 4)
    rates: tuple[float, ...] = ()
    requests: int = 30  # per level
    max_tokens: int = 16
    mix: tuple[str, ...] = MIXES
    deadline_s: float = 60.0
    duration_s: float = 120.0  # per level, whatever the request count
    max_outstanding: int = 64
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.2
    seed: int = 0
    rss_interval_s: float = 0.5
    pids: dict[str, int] = field(default_factory=dict)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    measure_floor: bool = True


@dataclass
class LoadReport:
    floor: LevelResult | None
    levels: list[LevelResult]
    rss_series: list[tuple[float, dict[str, float]]]

    def to_json(self) -> str:
        return json.dumps(
            {
                "floor": asdict(self.floor) if self.floor else None,
                "levels": [asdict(r) for r in self.levels],
                "rss_series": self.rss_series,
            }
        )


async def run_load(config: LoadConfig) -> LoadReport:
    requests = Requests(config.mix, config.max_tokens, config.seed)
    rng = random.Random(config.seed)
    results: list[LevelResult] = []
    floor = None
    with RssSampler(config.pids, config.rss_interval_s) as rss:
        async with aio_channel(config.address, config.security, channel_options()) as channel:
            stub = generator_pb2_grpc.GeneratorStub(channel)
            if config.measure_floor:
                t0, started = rss.now(), time.monotonic()
                samples = await closed_loop(
                    stub, requests, 1, min(8, config.requests), config.deadline_s, config.duration_s
                )
                floor = summarize(
                    "floor",
                    1,
                    samples,
                    time.monotonic() - started,
                    config.slo_ttft_s,
                    config.slo_itl_s,
                    rss.peak_since(t0),
                )
            for concurrency in config.concurrency:
                t0, started = rss.now(), time.monotonic()
                samples = await closed_loop(
                    stub, requests, concurrency, config.requests, config.deadline_s, config.duration_s
                )
                results.append(
                    summarize(
                        "closed",
                        concurrency,
                        samples,
                        time.monotonic() - started,
                        config.slo_ttft_s,
                        config.slo_itl_s,
                        rss.peak_since(t0),
                    )
                )
            for rate in config.rates:
                t0, started = rss.now(), time.monotonic()
                samples = await open_loop(
                    stub,
                    requests,
                    rate,
                    config.requests,
                    config.deadline_s,
                    config.duration_s,
                    config.max_outstanding,
                    rng,
                )
                results.append(
                    summarize(
                        "open",
                        rate,
                        samples,
                        time.monotonic() - started,
                        config.slo_ttft_s,
                        config.slo_itl_s,
                        rss.peak_since(t0),
                    )
                )
    return LoadReport(floor, results, rss.series)


def _numbers(text: str, kind: type) -> tuple:
    try:
        return tuple(kind(t) for t in text.split(",") if t.strip())
    except ValueError as exc:
        raise SystemExit(f"expected comma-separated numbers, got {text!r}") from exc


def _pids(text: str) -> dict[str, int]:
    out = {}
    for entry in (e for e in text.split(",") if e.strip()):
        name, _, pid = entry.rpartition("=")
        out[name or pid] = int(pid)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_load", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="host:port of a running router (or decode replica)")
    target.add_argument("--checkpoint", help="start a local cluster (deploy.launch.Cluster) on this checkpoint")
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--decoders", type=int, default=1)
    parser.add_argument("--redis", default="none", help="local cluster: 'none', 'auto' or a redis:// URL")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--concurrency", default="1,4", help="closed-loop levels (comma-separated)")
    parser.add_argument("--rates", default="", help="open-loop Poisson rates in requests/s (comma-separated)")
    parser.add_argument("--requests", type=int, default=30, help="requests per level")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mix", default=",".join(MIXES), help=f"request kinds from {MIXES}")
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--duration-s", type=float, default=120.0, help="cap per level")
    parser.add_argument("--max-outstanding", type=int, default=64, help="open loop: requests in flight")
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-itl-s", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-interval-s", type=float, default=0.5)
    parser.add_argument("--pids", default="", help="name=pid,... processes whose RSS to sample (--address)")
    parser.add_argument("--json", metavar="PATH", help="also write the full report (incl. RSS series) as JSON")
    add_security_args(parser, max_streams_per_client=None)
    args = parser.parse_args(argv)
    mix = tuple(m.strip() for m in args.mix.split(",") if m.strip())
    if not mix or set(mix) - set(MIXES):
        raise SystemExit(f"--mix: choose from {MIXES}")
    config = LoadConfig(
        address=args.address or "",
        concurrency=_numbers(args.concurrency, int),
        rates=_numbers(args.rates, float),
        requests=args.requests,
        max_tokens=args.max_tokens,
        mix=mix,
        deadline_s=args.deadline_s,
        duration_s=args.duration_s,
        max_outstanding=args.max_outstanding,
        slo_ttft_s=args.slo_ttft_s,
        slo_itl_s=args.slo_itl_s,
        seed=args.seed,
        rss_interval_s=args.rss_interval_s,
        pids=_pids(args.pids),
        security=security_settings(args),
    )
    with contextlib.ExitStack() as stack:
        if args.checkpoint:
            from deploy.launch import Cluster, ClusterSpec

            cluster = stack.enter_context(
                Cluster(
                    ClusterSpec(
                        checkpoint=args.checkpoint,
                        encoders=args.encoders,
                        decoders=args.decoders,
                        redis=args.redis,
                        device=args.device,
                        dtype=args.dtype,
                    )
                )
            )
            config.address = cluster.router_address
            config.pids = {p.name: p.popen.pid for p in cluster.processes() if p.popen is not None}
            print(f"local cluster: router {cluster.router_address}, logs {cluster.log_dir}", flush=True)
        report = asyncio.run(run_load(config))
    print(format_table(report.levels, report.floor))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json())
    failed = sum(sum(r.errors.values()) for r in report.levels)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
