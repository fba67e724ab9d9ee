"""The decode side's view of the encoder pool: per media item a cache lookup, else an `Encode` stream.

For a request's media items, in order:

1. `mm_key` per item (common/hashing) from the item's bytes, the preprocessing fingerprint computed by the
   encoder's own function (injected as `fingerprint_fn`) and the pool's encoder fingerprint (`GetInfo`);
2. the shared embedding cache (Redis) is read first; a hit skips the encoders;
3. misses are assigned by rendezvous hashing of `mm_key` over healthy replicas, skipping a replica whose
   in-flight items exceed a load cap; items of one replica go in one `Encode` call, calls run concurrently;
4. every stream is verified (order, sizes, CRC-32: `common.wire.StreamAssembler`); audio items arrive (and
   are cached) as dMel codes, which `DecodeService` turns into rows where it fuses them; a failed call is retried
   once on the next replica in rendezvous order within the remaining deadline; a replica that keeps failing
   opens its circuit breaker for a while;
5. with no encoder reachable, an optional in-process encoder (`local`) is used, else `UnavailableError`.

Replica health comes from `grpc.health.v1.Health/Watch` streams; addresses from a list or `dns:///name:port`
(re-resolved periodically). This module speaks gRPC and never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import aio_channel
from common.cache_store import EmbeddingCache, Entry
from common.errors import InklingError, InvalidInputError, UnavailableError
from common.grpc_util import channel_options
from common.hashing import mm_key
from common.media import MediaInput, media_to_proto
from common.settings import DEFAULT_MAX_MESSAGE_BYTES, SecuritySettings
from common.targets import rendezvous_order, resolve_targets
from common.wire import EncodedItem, ItemFailure, StreamAssembler, WireError
from proto.inkling_epd.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}


class LocalEncoder(Protocol):
    """In-process encoding used when no encoder replica is reachable (see `decode_service.local_encoder`)."""

    async def encode(self, items: Sequence[MediaInput], request_id: str) -> list[EncodedItem]: ...


class ClientObserver(Protocol):
    """Metric hooks (the decode server backs them with Prometheus)."""

    def cache_lookup(self, hit: bool) -> None: ...

    def rpc(self, address: str, seconds: float, code: str) -> None: ...

    def retry(self) -> None: ...

    def local_fallback(self) -> None: ...


class _NullObserver:
    def cache_lookup(self, hit: bool) -> None:
        pass

    def rpc(self, address: str, seconds: float, code: str) -> None:
        pass

    def retry(self) -> None:
        pass

    def local_fallback(self) -> None:
        pass


@dataclass(frozen=True)
class ClientSettings:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    load_slack: float = 0.25  # a replica is over the cap above (1 + slack) x the mean in-flight load
    breaker_failures: int = 3  # consecutive failed calls that open the breaker
    breaker_open_s: float = 5.0  # then one probe call is let through
    ready_wait_s: float = 5.0  # how long a request waits for a first healthy replica
    recheck_s: float = 1.0  # with none healthy: one direct health check of each replica, at most this long
    dns_refresh_s: float = 10.0
    watch_backoff_s: tuple[float, float] = (0.1, 2.0)  # reconnect backoff of health watches (min, max)
    security: SecuritySettings = field(default_factory=SecuritySettings)  # TLS / token to dial encoders


@dataclass(eq=False)
class EncoderReplica:
    address: str
    channel: grpc.aio.Channel
    stub: encoder_pb2_grpc.EncoderStub
    serving: bool = False
    fingerprint: bytes = b""
    dim: int = 0
    inflight: int = 0
    failures: int = 0
    open_until: float = 0.0
    watch: asyncio.Task | None = None

    def available(self, now: float) -> bool:
        return self.serving and bool(self.fingerprint) and now >= self.open_until


@dataclass
class _Group:
    replica: EncoderReplica
    indices: list[int] = field(default_factory=list)


class EncoderPoolUnavailableError(UnavailableError):
    """No encoder can serve the request's uncached media. The decode replica itself is fine, and every replica
    shares the encoder pool: the router does not retry elsewhere or mark the replica down."""


class EncoderCallError(InklingError):
    """One Encode call failed in a way another replica may not (transport, status, garbled stream)."""


class EncoderClient:
    """A pool of encoder replicas plus the embedding cache. Create, `await start()`, use, `await close()`."""

    def __init__(
        self,
        targets: Sequence[str],
        fingerprint_fn: Callable[[MediaInput, str], dict[str, Any]],
        cache: EmbeddingCache | None = None,
        local: LocalEncoder | None = None,
        local_fingerprint: bytes | None = None,
        settings: ClientSettings | None = None,
        observer: ClientObserver | None = None,
    ) -> None:
        self.targets = list(targets)
        self.fingerprint_fn = fingerprint_fn
        self.cache = cache
        self.local = local
        self.local_fingerprint = local_fingerprint
        self.settings = settings or ClientSettings()
        self.observer: ClientObserver = observer or _NullObserver()
        self.replicas: dict[str, EncoderReplica] = {}
        self._changed = asyncio.Event()
        self._refresher: asyncio.Task | None = None
        self._rechecking: asyncio.Future | None = None  # the direct health checks in flight (`_recheck`)
        self._background: set[asyncio.Task] = set()

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._refresh_addresses()
        if any(t.startswith("dns:///") for t in self.targets):
            self._refresher = asyncio.create_task(self._refresh_loop(), name="encoder-dns-refresh")

    async def close(self) -> None:
        for task in (self._refresher, self._rechecking):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for address in list(self.replicas):
            await self._drop(address)

    @property
    def inflight_items(self) -> int:
        return sum(r.inflight for r in self.replicas.values())

    def healthy(self) -> list[EncoderReplica]:
        now = time.monotonic()
        fingerprint = self.pool_fingerprint
        return [r for r in self.replicas.values() if r.available(now) and r.fingerprint == fingerprint]

    @property
    def pool_fingerprint(self) -> bytes | None:
        """The encoder fingerprint of the serving replicas (the most common one if they disagree)."""
        counts: dict[bytes, int] = {}
        for r in self.replicas.values():
            if r.serving and r.fingerprint:
                counts[r.fingerprint] = counts.get(r.fingerprint, 0) + 1
        if not counts:
            return self.local_fingerprint if self.local is not None else None
        return max(sorted(counts), key=lambda fp: counts[fp])

    @property
    def known_fingerprint(self) -> bytes | None:
        """The encoder fingerprint the replicas reported, serving or not (the most common one); None before any
        replica answered `GetInfo`."""
        counts: dict[bytes, int] = {}
        for r in self.replicas.values():
            if r.fingerprint:
                counts[r.fingerprint] = counts.get(r.fingerprint, 0) + 1
        return max(sorted(counts), key=lambda fp: counts[fp]) if counts else None

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until some replica is healthy (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))
        return True

    # -- the public call -------------------------------------------------------------------------------------

    async def encode(
        self, items: Sequence[MediaInput], request_id: str = "", timeout_s: float | None = None
    ) -> list[EncodedItem]:
        """Rows for every item, in item order (`item_index` = position in `items`).

        Raises `InvalidInputError` naming the item (`media[i]`), `UnavailableError` when no encoder can serve
        and local encoding is off, `TimeoutError` when the deadline passes.
        """
        if not items:
            return []
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 60.0)
        if not self.healthy() and self.replicas:
            remaining = max(0.0, deadline - time.monotonic())
            if self.known_fingerprint is None:
                # replicas still connecting (none has answered GetInfo yet): give them a moment
                await self.wait_ready(min(self.settings.ready_wait_s, remaining))
            else:
                # the pool was seen: ask each replica once (a restarted one may not be back in its watch yet),
                # then a pool with no healthy replica fails fast
                await self._recheck(min(self.settings.recheck_s, remaining))
        # The cache is read first, with no healthy encoder too (keyed by the last fingerprint the pool reported).
        fingerprint = self.pool_fingerprint if self.healthy() else (self.known_fingerprint or self.pool_fingerprint)
        if fingerprint is None:
            return await self._local_or_fail(items, request_id, "no healthy encoder replica")
        keys = [
            mm_key(m.modality, m.data, self.fingerprint_fn(m, f"media[{i}] ({m.modality})"), fingerprint)
            for i, m in enumerate(items)
        ]
        results: list[EncodedItem | None] = await self._from_cache(items, keys)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing and not self.healthy():
            local = await self._local_or_fail(
                [items[i] for i in missing],
                request_id,
                f"no healthy encoder replica for {len(missing)} uncached item(s)",
            )
            for index, item in zip(missing, local, strict=True):
                results[index] = _reindex(item, index)
        elif missing:
            for index, item in (await self._encode_remote(items, keys, missing, request_id, deadline)).items():
                results[index] = item
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    # -- cache -----------------------------------------------------------------------------------------------

    async def _from_cache(self, items: Sequence[MediaInput], keys: list[bytes]) -> list[EncodedItem | None]:
        if self.cache is None:
            return [None] * len(items)
        entries = await asyncio.to_thread(self.cache.get_many, keys)
        dim = self._pool_dim()
        out: list[EncodedItem | None] = []
        for i, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            item = self._cached_item(i, key, entry, items[i].modality, dim) if entry is not None else None
            self.observer.cache_lookup(item is not None)
            out.append(item)
        return out

    @staticmethod
    def _cached_item(index: int, key: bytes, entry: Entry, modality: str, dim: int) -> EncodedItem | None:
        if entry.modality != modality or entry.rows == 0 or (dim and entry.dim != dim):
            log.warning(
                "cached entry %s does not fit media[%d] (%s, dim %d); ignoring it",
                key.hex()[:16],
                index,
                entry.modality,
                entry.dim,
            )
            return None
        return EncodedItem(
            item_index=index,
            mm_key=key,
            modality=entry.modality,
            rows=entry.rows,
            dim=entry.dim,
            payload=entry.payload,
            spans=entry.spans,
            cache_hit=True,
            dtype=entry.dtype,
            kind=entry.kind,
            codes_per_row=entry.codes_per_row,
            tower_dtype=entry.tower_dtype,
        )

    def _pool_dim(self) -> int:
        dims = [r.dim for r in self.healthy() if r.dim]
        return dims[0] if dims else 0

    # -- remote encoding -------------------------------------------------------------------------------------

    def _assign(self, keys: list[bytes], indices: list[int], exclude: set[str]) -> list[_Group]:
        """Rendezvous choice per item with a load cap; one group per chosen replica."""
        replicas = {r.address: r for r in self.healthy() if r.address not in exclude}
        if not replicas:
            return []
        planned = {a: r.inflight for a, r in replicas.items()}
        total = sum(planned.values()) + len(indices)
        cap = max(1, math.ceil((1.0 + self.settings.load_slack) * total / len(replicas)))
        groups: dict[str, _Group] = {}
        for index in indices:
            order = rendezvous_order(keys[index], list(replicas))
            choice = next((a for a in order if planned[a] < cap), order[0])
            planned[choice] += 1
            groups.setdefault(choice, _Group(replicas[choice])).indices.append(index)
        return list(groups.values())

    async def _encode_remote(
        self, items: Sequence[MediaInput], keys: list[bytes], indices: list[int], request_id: str, deadline: float
    ) -> dict[int, EncodedItem]:
        groups = self._assign(keys, indices, exclude=set())
        outcomes = await asyncio.gather(
            *(self._group_with_retry(g, items, keys, request_id, deadline) for g in groups), return_exceptions=True
        )
        results: dict[int, EncodedItem] = {}
        fallback: list[int] = []
        for group, outcome in zip(groups, outcomes, strict=True):
            if isinstance(outcome, EncoderCallError):
                fallback.extend(group.indices)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results.update(outcome)
        if fallback:
            local = await self._local_or_fail(
                [items[i] for i in fallback], request_id, "encoder calls failed on every replica tried"
            )
            for index, item in zip(fallback, local, strict=True):
                results[index] = _reindex(item, index)
        return results

    async def _group_with_retry(
        self, group: _Group, items: Sequence[MediaInput], keys: list[bytes], request_id: str, deadline: float
    ) -> dict[int, EncodedItem]:
        try:
            return await self._call(group, items, keys, request_id, deadline)
        except EncoderCallError as first:
            retry_to = self._next_replica(keys[group.indices[0]], exclude={group.replica.address})
            if retry_to is None or deadline - time.monotonic() <= 0:
                raise
            self.observer.retry()
            log.info(
                "request %s: retrying %d item(s) on %s after: %s",
                request_id,
                len(group.indices),
                retry_to.address,
                first,
            )
            return await self._call(_Group(retry_to, group.indices), items, keys, request_id, deadline)

    def _next_replica(self, key: bytes, exclude: set[str]) -> EncoderReplica | None:
        candidates = {r.address: r for r in self.healthy() if r.address not in exclude}
        order = rendezvous_order(key, list(candidates))
        return candidates[order[0]] if order else None

    async def _call(
        self, group: _Group, items: Sequence[MediaInput], keys: list[bytes], request_id: str, deadline: float
    ) -> dict[int, EncodedItem]:
        replica, indices = group.replica, group.indices
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"request {request_id}: deadline passed before encoding media")
        request = encoder_pb2.EncodeRequest(
            request_id=request_id,
            items=[media_to_proto(items[i]) for i in indices],
            expected_encoder_fingerprint=replica.fingerprint,
            continue_on_item_error=True,
        )
        replica.inflight += len(indices)
        started = time.monotonic()
        code = "OK"
        try:
            received = await self._stream(replica, request, len(indices), remaining)
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidInputError(f"media: encoder rejected the request: {exc.details()}") from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and deadline - time.monotonic() <= 0:
                raise TimeoutError(f"request {request_id}: deadline exceeded while encoding media") from None
            if exc.code() not in _RETRYABLE:
                raise EncoderCallError(f"{replica.address}: {code} {exc.details()}") from None
            self._failed(replica, exc.code() == grpc.StatusCode.FAILED_PRECONDITION)
            raise EncoderCallError(f"{replica.address}: {code} {exc.details()}") from None
        except WireError as exc:
            code = "GARBLED"
            self._failed(replica, False)
            raise EncoderCallError(f"{replica.address}: garbled Encode stream ({exc})") from None
        finally:
            replica.inflight -= len(indices)
            self.observer.rpc(replica.address, time.monotonic() - started, code)
        replica.failures = 0
        out: dict[int, EncodedItem] = {}
        for local_index, result in enumerate(received):
            index = indices[local_index]
            if isinstance(result, ItemFailure):
                if result.code == "INVALID_ARGUMENT":
                    raise InvalidInputError(item_error(index, items[index].modality, result.message))
                raise EncoderCallError(f"{replica.address}: media[{index}]: {result.code} {result.message}")
            if result.mm_key != keys[index]:
                log.warning(
                    "request %s: media[%d] key from %s differs from ours (preprocessing fingerprints "
                    "out of sync); cache lookups will miss",
                    request_id,
                    index,
                    replica.address,
                )
            if result.modality != items[index].modality or (replica.dim and result.dim != replica.dim):
                raise EncoderCallError(
                    f"{replica.address}: media[{index}] came back as {result.modality} with dim {result.dim}"
                )
            out[index] = _reindex(result, index, keys[index])
        return out

    @staticmethod
    async def _stream(
        replica: EncoderReplica, request: encoder_pb2.EncodeRequest, expected: int, timeout_s: float
    ) -> list[EncodedItem | ItemFailure]:
        assembler = StreamAssembler(expected_items=expected)
        out: list[EncodedItem | ItemFailure] = []
        call = replica.stub.Encode(request, timeout=timeout_s)
        try:
            async for message in call:
                done = assembler.add(message)
                if done is not None:
                    out.append(done)
            assembler.finish()
        finally:
            call.cancel()
        return out

    def _failed(self, replica: EncoderReplica, stale_fingerprint: bool) -> None:
        replica.failures += 1
        if stale_fingerprint:
            replica.fingerprint = b""  # re-read now; the replica is skipped until then
            task = asyncio.create_task(self._load_info(replica))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        if replica.failures >= self.settings.breaker_failures:
            replica.open_until = time.monotonic() + self.settings.breaker_open_s
            replica.failures = self.settings.breaker_failures - 1  # half-open: one more failure re-opens
            log.warning("encoder %s: circuit open for %.1fs", replica.address, self.settings.breaker_open_s)

    async def _local_or_fail(self, items: Sequence[MediaInput], request_id: str, why: str) -> list[EncodedItem]:
        if self.local is None:
            raise EncoderPoolUnavailableError(f"request {request_id}: cannot encode media: {why}")
        self.observer.local_fallback()
        log.info("request %s: encoding %d item(s) in-process (%s)", request_id, len(items), why)
        return await self.local.encode(items, request_id)

    # -- replica set and health ------------------------------------------------------------------------------

    async def _refresh_addresses(self) -> None:
        wanted = set(await resolve_targets(self.targets))
        for address in wanted - set(self.replicas):
            self._add(address)
        for address in set(self.replicas) - wanted:
            await self._drop(address)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.dns_refresh_s)
            await self._refresh_addresses()

    def _add(self, address: str) -> None:
        channel = aio_channel(address, self.settings.security, channel_options(self.settings.max_message_bytes))
        replica = EncoderReplica(address, channel, encoder_pb2_grpc.EncoderStub(channel))
        replica.watch = asyncio.create_task(self._watch(replica), name=f"encoder-health-{address}")
        self.replicas[address] = replica

    async def _drop(self, address: str) -> None:
        replica = self.replicas.pop(address)
        if replica.watch is not None:
            replica.watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replica.watch
        await replica.channel.close()

    async def _watch(self, replica: EncoderReplica) -> None:
        """Follow the replica's health stream; reconnect with backoff when it breaks."""
        stub = health_pb2_grpc.HealthStub(replica.channel)
        low, high = self.settings.watch_backoff_s
        backoff = low
        while True:
            try:
                async for response in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    serving = response.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and not replica.fingerprint:
                        await self._load_info(replica)
                        if not replica.fingerprint:
                            break  # reconnect after a backoff; the first message of the new watch retries
                    self._set_serving(replica, serving)
                    backoff = low
            except grpc.aio.AioRpcError as exc:
                log.debug("health watch of %s ended: %s", replica.address, exc.code().name)
            self._set_serving(replica, False)
            await asyncio.sleep(backoff)
            backoff = min(high, backoff * 2)

    async def _recheck(self, timeout_s: float) -> None:
        """One direct `Health/Check` of every replica not serving, shared by the requests that arrive meanwhile
        (the health watches reconnect with backoff, so a replica back from a restart can be SERVING before its
        watch says so); a replica that answers SERVING is used at once."""
        if self._rechecking is None or self._rechecking.done():
            self._rechecking = asyncio.ensure_future(
                asyncio.gather(*(self._check(r, timeout_s) for r in list(self.replicas.values()) if not r.serving))
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._rechecking), timeout_s)

    async def _check(self, replica: EncoderReplica, timeout_s: float) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        try:
            stub = health_pb2_grpc.HealthStub(replica.channel)
            response = await stub.Check(request, timeout=timeout_s, wait_for_ready=True)  # through a reconnect
        except grpc.aio.AioRpcError:
            return
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            if not replica.fingerprint:
                await self._load_info(replica)
            if replica.fingerprint:
                self._set_serving(replica, True)

    async def _load_info(self, replica: EncoderReplica) -> None:
        try:
            info = await replica.stub.GetInfo(encoder_pb2.EncoderInfoRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("GetInfo on %s failed: %s", replica.address, exc.code().name)
            return
        replica.fingerprint, replica.dim = info.encoder_fingerprint, info.dim
        self._changed.set()

    def _set_serving(self, replica: EncoderReplica, serving: bool) -> None:
        if replica.serving != serving:
            log.info("encoder %s is %s", replica.address, "SERVING" if serving else "NOT_SERVING")
            replica.serving = serving
            if serving:
                replica.failures, replica.open_until = 0, 0.0
        self._changed.set()


_ENCODER_ITEM_PREFIX = re.compile(r"^item \d+ \(\w+\): ")


def item_error(index: int, modality: str, message: str) -> str:
    """An encoder's item error named after the request's `media[index]`: the encoder's own `item N (modality): `
    prefix (its position in one Encode call, not in the request) is replaced, not repeated."""
    return f"media[{index}] ({modality}): {_ENCODER_ITEM_PREFIX.sub('', message)}"


def _reindex(item: EncodedItem, index: int, key: bytes | None = None) -> EncodedItem:
    return dataclasses.replace(item, item_index=index, mm_key=key or item.mm_key)
