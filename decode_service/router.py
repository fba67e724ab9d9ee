"""`inkling-epd router`: the `Generator` service in front of a pool of decode replicas.

Choice: the replica holding the longest cached prefix of the request (prefix directory in Redis), unless it is
busier than the least-loaded healthy replica by more than a slack; otherwise the least-loaded one. Load =
max(running + waiting from the replica's polled `GetLoad`, this router's own open calls to it).

Failures: a replica that fails before its first message (UNAVAILABLE, RESOURCE_EXHAUSTED, server-side
CANCELLED, UNKNOWN) is skipped and the call retried on another one. Once a message has been forwarded, a
failure ends the call with UNAVAILABLE (or the replica's own request-level code) and nothing is replayed: the
client never sees duplicated output. A client cancellation cancels the upstream call. `Abort` fans out to
every replica. The serving replica's address travels back as initial metadata `inkling-replica`, sent with
the first forwarded message.

Prefix directory: the router looks up the request's routing hashes (`common.prefix_routing`, the contract
with the decode replicas, which publish them) and prefers the replica holding the longest run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.auth import aio_channel, bind_server, server_interceptors
from common.errors import ConfigError, InvalidInputError
from common.grpc_util import (
    SERVING,
    UNAVAILABLE_DEPENDENCY_KEY,
    ServerHealth,
    channel_options,
    create_server,
    enable_reflection,
    graceful_stop,
)
from common.metrics import MetricsServer, ModelLabelled, new_registry, start_metrics_server
from common.prefix_routing import PrefixDirectory, prefix_directory_key, request_prefix_hashes
from common.request_ids import check_request_id
from common.settings import (
    GrpcSettings,
    RedisSettings,
    SecuritySettings,
    env_log_level,
    redis_settings,
    security_settings,
)
from common.targets import parse_targets, resolve_targets
from proto.inkling_epd.v1 import generator_pb2, generator_pb2_grpc

log = logging.getLogger(__name__)

# Re-exported: tests and tools still name the directory's helpers through the router.
__all__ = ["PrefixDirectory", "Router", "parse_targets", "prefix_directory_key", "request_prefix_hashes"]

GENERATOR_SERVICE = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name
# Initial-metadata key naming the decode replica (its address) that serves a routed Generate call.
REPLICA_METADATA_KEY = "inkling-replica"

# ----------------------------------------------------------------------------------------------------------
# Replica pool


@dataclass
class DecodeReplica:
    address: str
    channel: grpc.aio.Channel
    stub: generator_pb2_grpc.GeneratorStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    polled_load: int = 0  # running + waiting at the last GetLoad
    inflight: int = 0  # this router's open Generate calls
    last_load: generator_pb2.Load | None = None

    @property
    def load(self) -> int:
        return max(self.polled_load, self.inflight)

    @classmethod
    def connect(cls, address: str, security: SecuritySettings | None = None) -> DecodeReplica:
        channel = aio_channel(address, security, channel_options())
        return cls(address, channel, generator_pb2_grpc.GeneratorStub(channel), health_pb2_grpc.HealthStub(channel))


@dataclass(frozen=True)
class Choice:
    replica: DecodeReplica
    reason: str  # "prefix" or "least_loaded"


class ReplicaPool:
    """The decode replicas: resolution, health + load polling, and the routing choice."""

    def __init__(
        self,
        targets: Sequence[str],
        rpc_timeout_s: float,
        load_slack: int,
        load_slack_frac: float,
        security: SecuritySettings | None = None,
    ) -> None:
        self.targets = tuple(targets)
        self.security = security
        self.rpc_timeout_s = rpc_timeout_s
        self.load_slack = load_slack
        self.load_slack_frac = load_slack_frac
        self.replicas: dict[str, DecodeReplica] = {}
        self._retired: list[DecodeReplica] = []
        self._tie = itertools.count()

    def healthy(self) -> list[DecodeReplica]:
        return [r for r in self.replicas.values() if r.healthy]

    async def resolve(self) -> None:
        addresses = await resolve_targets(self.targets)
        if not addresses:
            return  # keep what we have while DNS is failing
        for address in addresses:
            if address not in self.replicas:
                self.replicas[address] = DecodeReplica.connect(address, self.security)
                log.info("decode replica %s added", address)
        for address in [a for a in self.replicas if a not in addresses]:
            self._retired.append(self.replicas.pop(address))
            log.info("decode replica %s removed", address)
        still_busy = []
        for replica in self._retired:
            if replica.inflight:
                still_busy.append(replica)
            else:
                await replica.channel.close()
        self._retired = still_busy

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(r) for r in list(self.replicas.values())))

    async def _poll_one(self, replica: DecodeReplica) -> None:
        try:
            check = await replica.health.Check(health_pb2.HealthCheckRequest(), timeout=self.rpc_timeout_s)
            load = await replica.stub.GetLoad(generator_pb2.LoadRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if replica.healthy:
                log.warning("decode replica %s unhealthy: %s", replica.address, exc.code().name)
            replica.healthy = False
            return
        if not replica.healthy and check.status == SERVING:
            log.info("decode replica %s healthy", replica.address)
        replica.healthy = check.status == SERVING
        replica.last_load = load
        replica.polled_load = load.running_requests + load.waiting_requests

    def choose(self, prefix_matches: dict[str, int], exclude: set[str]) -> Choice | None:
        candidates = [r for r in self.healthy() if r.address not in exclude]
        if not candidates:
            return None
        min_load = min(r.load for r in candidates)
        bound = min_load + max(self.load_slack, math.ceil(min_load * self.load_slack_frac))
        with_prefix = [r for r in candidates if prefix_matches.get(r.address, 0) > 0 and r.load <= bound]
        if with_prefix:
            best = max(with_prefix, key=lambda r: (prefix_matches[r.address], -r.load))
            return Choice(best, "prefix")
        least = [r for r in candidates if r.load == min_load]
        return Choice(least[next(self._tie) % len(least)], "least_loaded")

    async def close(self) -> None:
        for replica in [*self.replicas.values(), *self._retired]:
            await replica.channel.close()
        self.replicas.clear()
        self._retired.clear()


# ----------------------------------------------------------------------------------------------------------
# Servicer

# Upstream codes meaning "this replica could not take the call": retried while nothing was forwarded yet.
_REPLICA_FAILURES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)


# A caller's cancellation this close to its deadline is that deadline passing: the caller's timer fires first (our
# deadline starts when the call arrives) and its cancel may reach us before our own timer does.
_DEADLINE_SLACK_S = 0.25


class RouterMetrics:
    """Every series carries `model_name` (the model the replicas serve, `--model-name`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str = "inkling") -> None:
        self.registry = registry
        m = ["model_name"]
        self.requests = ModelLabelled(
            Counter("inkling_router_requests", "Generate calls by final status code", m + ["code"], registry=registry),
            model_name,
        )
        self.routed = ModelLabelled(
            Counter(
                "inkling_router_routed",
                "Upstream attempts by replica and reason",
                m + ["replica", "reason"],
                registry=registry,
            ),
            model_name,
        )
        self.retries = Counter(
            "inkling_router_retries", "Attempts retried on another replica", m, registry=registry
        ).labels(model_name)
        self.failed_after_first = Counter(
            "inkling_router_failed_after_first_message",
            "Calls that failed after output was forwarded",
            m,
            registry=registry,
        ).labels(model_name)
        self.directory_errors = Counter(
            "inkling_router_prefix_directory_errors",
            "Prefix directory lookups that failed (routed least-loaded)",
            m,
            registry=registry,
        ).labels(model_name)
        self.ttft = Histogram(
            "inkling_router_first_message_seconds", "Router-side time to the first message", m, registry=registry
        ).labels(model_name)
        self.healthy_replicas = Gauge(
            "inkling_router_healthy_replicas", "Decode replicas SERVING", m, registry=registry
        ).labels(model_name)


class RouterServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(
        self,
        pool: ReplicaPool,
        directory: PrefixDirectory | None,
        metrics: RouterMetrics,
        max_attempts: int,
        rpc_timeout_s: float,
        directory_timeout_s: float,
    ) -> None:
        self.pool = pool
        self.directory = directory
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.rpc_timeout_s = rpc_timeout_s
        self.directory_timeout_s = directory_timeout_s

    async def _prefix_matches(self, request: generator_pb2.GenerateRequest) -> dict[str, int]:
        if self.directory is None:
            return {}
        hashes = request_prefix_hashes(request)
        if not hashes:
            return {}
        try:
            return await asyncio.wait_for(self.directory.lookup(hashes), self.directory_timeout_s)
        except Exception as exc:  # a slow or broken Redis only costs affinity
            self.metrics.directory_errors.inc()
            log.debug("prefix directory lookup failed: %r", exc)
            return {}

    async def Generate(
        self, request: generator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generator_pb2.GenerateResponse]:
        start = time.monotonic()
        try:
            check_request_id(request.request_id)
        except InvalidInputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        matches = await self._prefix_matches(request)
        tried: set[str] = set()
        last_error = "no healthy decode replica"
        last_code = grpc.StatusCode.UNAVAILABLE
        while len(tried) < self.max_attempts:
            choice = self.pool.choose(matches, tried)
            if choice is None:
                break
            replica = choice.replica
            if tried:
                self.metrics.retries.inc()
            tried.add(replica.address)
            self.metrics.routed.labels(replica.address, choice.reason).inc()
            call = replica.stub.Generate(request, timeout=context.time_remaining())
            replica.inflight += 1
            forwarded = 0
            try:
                async for response in call:
                    if not forwarded:
                        self.metrics.ttft.observe(time.monotonic() - start)
                        await context.send_initial_metadata(((REPLICA_METADATA_KEY, replica.address),))
                    forwarded += 1
                    yield response
            except asyncio.CancelledError:  # the client cancelled, or its deadline passed
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= _DEADLINE_SLACK_S
                self.metrics.requests.labels("DEADLINE_EXCEEDED" if expired else "CANCELLED").inc()
                raise
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                log.log(
                    logging.WARNING if code in _REPLICA_FAILURES else logging.INFO,
                    "request %s: decode replica %s ended the call with %s after %d messages",
                    request.request_id,
                    replica.address,
                    code.name,
                    forwarded,
                )
                if forwarded:
                    self.metrics.failed_after_first.inc()
                    surfaced = grpc.StatusCode.UNAVAILABLE if code in _REPLICA_FAILURES else code
                    self.metrics.requests.labels(surfaced.name).inc()
                    await context.abort(
                        surfaced, f"decode replica {replica.address} failed after {forwarded} messages: {exc.details()}"
                    )
                dependency = any(k == UNAVAILABLE_DEPENDENCY_KEY for k, _ in exc.trailing_metadata() or ())
                if code not in _REPLICA_FAILURES or dependency:
                    self.metrics.requests.labels(code.name).inc()
                    await context.abort(code, exc.details() or code.name)
                if code == grpc.StatusCode.UNAVAILABLE:
                    replica.healthy = False  # until the next successful poll
                last_error = f"decode replica {replica.address}: {code.name}: {exc.details()}"
                exhausted = code == grpc.StatusCode.RESOURCE_EXHAUSTED
                last_code = code if exhausted else grpc.StatusCode.UNAVAILABLE
                continue
            finally:
                replica.inflight -= 1
                if not call.done():
                    call.cancel()  # our caller went away (or we are being stopped): stop the replica's work
            self.metrics.requests.labels("OK").inc()
            return
        self.metrics.requests.labels(last_code.name).inc()
        await context.abort(last_code, last_error)

    async def Abort(
        self, request: generator_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generator_pb2.AbortResponse:
        if not request.request_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_ids: at least one id is required")
        replicas = list(self.pool.replicas.values())
        results = await asyncio.gather(
            *(r.stub.Abort(request, timeout=self.rpc_timeout_s) for r in replicas), return_exceptions=True
        )
        aborted: dict[str, None] = {}
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError) and result.code() == grpc.StatusCode.NOT_FOUND:
                continue  # the ids live elsewhere (or nowhere)
            if isinstance(result, BaseException):
                log.warning("abort fan-out to %s failed: %r", replica.address, result)
                continue
            aborted.update(dict.fromkeys(result.aborted_request_ids))
        if not aborted:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"request_ids: none of {list(request.request_ids)[:8]} is running or queued on any replica",
            )
        return generator_pb2.AbortResponse(aborted_request_ids=list(aborted))

    async def GetLoad(
        self, request: generator_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> generator_pb2.Load:
        loads = [r.last_load for r in self.pool.healthy() if r.last_load is not None]
        if not loads:
            return generator_pb2.Load()
        return generator_pb2.Load(
            running_requests=sum(x.running_requests for x in loads),
            waiting_requests=sum(x.waiting_requests for x in loads),
            kv_usage=sum(x.kv_usage for x in loads) / len(loads),
            free_kv_pages=sum(x.free_kv_pages for x in loads),
            prefix_cache_hit_rate=sum(x.prefix_cache_hit_rate for x in loads) / len(loads),
            inflight_encode_items=sum(x.inflight_encode_items for x in loads),
        )

    async def GetModelInfo(
        self, request: generator_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generator_pb2.ModelInfo:
        for replica in self.pool.healthy():
            try:
                return await replica.stub.GetModelInfo(request, timeout=self.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("GetModelInfo on %s failed: %s", replica.address, exc.code().name)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy decode replica")


# ----------------------------------------------------------------------------------------------------------
# Server


@dataclass(frozen=True)
class RouterConfig:
    decoders: tuple[str, ...]
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    metrics_port: int = 0  # 0: no exporter
    redis: RedisSettings | None = None
    poll_interval_s: float = 0.5  # health + GetLoad of every replica
    resolve_interval_s: float = 5.0  # DNS re-resolution of dns:/// targets
    rpc_timeout_s: float = 2.0  # control RPCs (Check, GetLoad, Abort, GetModelInfo)
    directory_timeout_s: float = 0.05  # a slower prefix lookup is skipped
    max_attempts: int = 3  # replicas tried per Generate before the first message
    load_slack: int = 4  # a prefix holder is preferred while its load <= min load + max(slack, ...
    load_slack_frac: float = 0.5  # ... this fraction of the min load)
    prefix_namespace: str = ""
    log_level: str = "INFO"
    model_name: str = "inkling"  # the model id the replicas serve: the metrics' model_name label

    def __post_init__(self) -> None:
        for name in ("poll_interval_s", "resolve_interval_s", "rpc_timeout_s", "directory_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"router {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_attempts < 1 or self.load_slack < 0 or self.load_slack_frac < 0:
            raise ConfigError("router max_attempts must be >= 1 and load slack >= 0")


def router_config(args: argparse.Namespace) -> RouterConfig:
    """Config from the `inkling-epd router` flags."""
    return RouterConfig(
        decoders=parse_targets(args.decoders, "--decoders"),
        grpc=GrpcSettings(host=args.host, port=args.port, grace_s=args.grace_seconds, security=security_settings(args)),
        metrics_port=args.metrics_port,
        redis=redis_settings(args.redis_url),
        log_level=(getattr(args, "log_level", None) or env_log_level()).upper(),
        model_name=getattr(args, "model_name", None) or "inkling",
    )


class Router:
    """The router server: build, `await start()`, `await stop()`; `port` is known after start."""

    def __init__(self, config: RouterConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.metrics = RouterMetrics(registry or new_registry(), config.model_name)
        self.pool = ReplicaPool(
            config.decoders, config.rpc_timeout_s, config.load_slack, config.load_slack_frac, config.grpc.security
        )
        self._redis = None
        directory = None
        if config.redis is not None:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(
                config.redis.url, socket_timeout=config.redis.timeout_s, socket_connect_timeout=config.redis.timeout_s
            )
            directory = PrefixDirectory(self._redis, config.prefix_namespace)
        self.server = create_server(
            config.grpc.max_message_bytes,
            server_interceptors(config.grpc.security),
            max_request_bytes=config.grpc.max_request_bytes,
        )
        self.servicer = RouterServicer(
            self.pool, directory, self.metrics, config.max_attempts, config.rpc_timeout_s, config.directory_timeout_s
        )
        generator_pb2_grpc.add_GeneratorServicer_to_server(self.servicer, self.server)
        self.health = ServerHealth(self.server, [GENERATOR_SERVICE])
        enable_reflection(self.server, [GENERATOR_SERVICE])
        self.port = 0
        self._serving: bool | None = None
        self._monitor: asyncio.Task | None = None
        self._metrics_server: MetricsServer | None = None

    @property
    def address(self) -> str:
        return f"{self.config.grpc.host}:{self.port}"

    async def start(self) -> int:
        self.port = bind_server(self.server, self.config.grpc.host, self.config.grpc.port, self.config.grpc.security)
        await self.health.not_serving()
        await self.pool.resolve()
        await self.pool.poll()
        await self._update_health()
        await self.server.start()
        if self.config.metrics_port:
            self._metrics_server = start_metrics_server(
                self.config.metrics_port, self.metrics.registry, self.config.grpc.host
            )
        self._monitor = asyncio.create_task(self._watch_replicas())
        log.info("router serving on %s, replicas %s", self.address, ",".join(self.pool.replicas) or "(none yet)")
        return self.port

    async def _watch_replicas(self) -> None:
        last_resolve = time.monotonic()
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                if time.monotonic() - last_resolve >= self.config.resolve_interval_s:
                    last_resolve = time.monotonic()
                    await self.pool.resolve()
                await self.pool.poll()
                await self._update_health()
            except Exception:
                log.exception("replica monitor iteration failed")

    async def _update_health(self) -> None:
        healthy = len(self.pool.healthy())
        self.metrics.healthy_replicas.set(healthy)
        serving = healthy > 0
        if serving != self._serving:
            self._serving = serving
            await (self.health.serving() if serving else self.health.not_serving())
            log.info("router %s (%d healthy decode replicas)", "SERVING" if serving else "NOT_SERVING", healthy)

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, let running calls finish within the grace period, then release everything."""
        grace = self.config.grpc.grace_s if grace_s is None else grace_s
        await graceful_stop(self.server, self.health, grace)
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        await self.pool.close()
        if self._redis is not None:
            await self._redis.aclose()
        if self._metrics_server is not None:
            self._metrics_server.stop()
        log.info("router on %s stopped", self.address)


async def _serve(config: RouterConfig) -> None:
    router = Router(config)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("router draining (grace %.1f s)", config.grpc.grace_s)
    await router.stop()


def serve(args: argparse.Namespace) -> int:
    config = router_config(args)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(_serve(config))
    return 0
