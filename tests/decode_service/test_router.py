"""The router against fake in-process decode replicas (tiny `Generator` servicers on port 0)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_util import UNAVAILABLE_DEPENDENCY_KEY, ServerHealth, bind, create_server
from common.prefix_routing import PREFIX_DIRECTORY_PREFIX, ROUTING_BLOCK_TOKENS
from common.settings import GrpcSettings, RedisSettings
from decode_service.router import (
    GENERATOR_SERVICE,
    PrefixDirectory,
    Router,
    RouterConfig,
    prefix_directory_key,
    request_prefix_hashes,
)
from deploy.launch import free_port
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc

REDIS_URL = "redis://127.0.0.1:6379/15"


class FakeReplica(generator_pb2_grpc.GeneratorServicer):
    """Streams one delta carrying its name, then a Final; `mode` injects failures."""

    def __init__(self, name: str, running: int = 0, waiting: int = 0, mode: str = "ok") -> None:
        self.name = name
        self.running = running
        self.waiting = waiting
        self.mode = mode
        self.calls: list[str] = []
        self.aborted: list[str] = []
        self.cancelled = asyncio.Event()
        self.address = ""

    async def Generate(self, request, context):
        self.calls.append(request.request_id)
        if self.mode == "fail_before":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica going down")
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty")
        if self.mode == "encoders_down":
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "cannot encode media: no healthy encoder replica",
                trailing_metadata=((UNAVAILABLE_DEPENDENCY_KEY, "encoder"),),
            )
        yield pb.GenerateResponse(delta=pb.Delta(token_ids=[1], text=self.name))
        if self.mode == "fail_after":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica crashed")
        if self.mode == "slow":
            await asyncio.sleep(0.5)
        if self.mode == "hang":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        yield pb.GenerateResponse(
            final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(completion_tokens=1))
        )

    async def Abort(self, request, context):
        self.aborted.extend(request.request_ids)
        found = [i for i in request.request_ids if i in self.calls]
        if not found:  # as the decode server does
            await context.abort(grpc.StatusCode.NOT_FOUND, "request_ids: none is live here")
        return pb.AbortResponse(aborted_request_ids=found)

    async def GetLoad(self, request, context):
        return pb.Load(running_requests=self.running, waiting_requests=self.waiting, kv_usage=0.5, free_kv_pages=10)

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_id=self.name)


@contextlib.asynccontextmanager
async def fake_replica(replica: FakeReplica, serving: bool = True) -> AsyncIterator[ServerHealth]:
    server = create_server()
    generator_pb2_grpc.add_GeneratorServicer_to_server(replica, server)
    health = ServerHealth(server, [GENERATOR_SERVICE])
    replica.address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    await (health.serving() if serving else health.not_serving())
    try:
        yield health
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def routed(*replicas: FakeReplica, serving: bool = True, **overrides) -> AsyncIterator[Router]:
    """Start the fake replicas and a router in front of them; yields the started router."""
    async with contextlib.AsyncExitStack() as stack:
        for replica in replicas:
            await stack.enter_async_context(fake_replica(replica, serving))
        config = RouterConfig(
            decoders=tuple(r.address for r in replicas),
            grpc=GrpcSettings(host="127.0.0.1", port=0, grace_s=0.5),
            poll_interval_s=0.05,
            **overrides,
        )
        router = Router(config)
        await router.start()
        try:
            yield router
        finally:
            await router.stop(0.2)


def _stub(channel: grpc.aio.Channel) -> generator_pb2_grpc.GeneratorStub:
    return generator_pb2_grpc.GeneratorStub(channel)


def _request(request_id: str = "r1", tokens: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, tokens=pb.TokenPrompt(token_ids=list(range(tokens))))


async def _generate(router: Router, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(router.address) as channel:
        return [r async for r in _stub(channel).Generate(request, timeout=10)]


def test_routes_to_least_loaded_and_aggregates_load():
    a, b, c = FakeReplica("a", running=5), FakeReplica("b", running=1), FakeReplica("c", running=2, waiting=1)

    async def scenario():
        async with routed(a, b, c) as router:
            for i in range(3):
                out = await _generate(router, _request(f"r{i}"))
                assert out[0].delta.text == "b" and out[-1].HasField("final")
            async with grpc.aio.insecure_channel(router.address) as channel:
                load = await _stub(channel).GetLoad(pb.LoadRequest(), timeout=5)
                info = await _stub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=5)
        assert (load.running_requests, load.waiting_requests, load.free_kv_pages) == (8, 1, 30)
        assert load.kv_usage == pytest.approx(0.5)
        assert info.model_id in ("a", "b", "c")

    asyncio.run(scenario())
    assert b.calls == ["r0", "r1", "r2"] and not a.calls and not c.calls


def test_retries_on_another_replica_before_the_first_message():
    broken, spare = FakeReplica("broken", mode="fail_before"), FakeReplica("spare", running=3)

    async def scenario():
        async with routed(broken, spare) as router:
            return await _generate(router, _request())

    out = asyncio.run(scenario())
    assert broken.calls == ["r1"] and spare.calls == ["r1"]
    assert [r.delta.text for r in out if r.HasField("delta")] == ["spare"]
    assert out[-1].final.finish_reason == pb.FINISH_REASON_STOP


def test_no_retry_after_the_first_message():
    crashing, spare = FakeReplica("crashing", mode="fail_after"), FakeReplica("spare", running=3)

    async def scenario():
        async with routed(crashing, spare) as router:
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async with grpc.aio.insecure_channel(router.address) as channel:
                    async for response in _stub(channel).Generate(_request(), timeout=10):
                        received.append(response)
            return received, err.value

    received, error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert [r.delta.text for r in received] == ["crashing"]  # delivered once, never replayed
    assert crashing.calls == ["r1"] and spare.calls == []


def test_request_errors_pass_through_without_retry():
    bad, spare = FakeReplica("bad", mode="invalid"), FakeReplica("spare", running=3)

    async def scenario():
        async with routed(bad, spare) as router:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(router, _request())
            return err.value

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in error.details()
    assert spare.calls == []


def test_all_replicas_failing_gives_unavailable():
    replicas = [FakeReplica(f"x{i}", mode="fail_before") for i in range(2)]

    async def scenario():
        async with routed(*replicas) as router:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(router, _request())
            return err.value

    assert asyncio.run(scenario()).code() == grpc.StatusCode.UNAVAILABLE
    assert all(r.calls == ["r1"] for r in replicas)


def test_client_cancellation_cancels_the_upstream_call():
    slow = FakeReplica("slow", mode="hang")

    async def scenario():
        async with routed(slow) as router:
            async with grpc.aio.insecure_channel(router.address) as channel:
                call = _stub(channel).Generate(_request(), timeout=20)
                first = await call.read()
                assert first.delta.text == "slow"
                call.cancel()
                await asyncio.wait_for(slow.cancelled.wait(), 5)

    asyncio.run(scenario())
    assert slow.cancelled.is_set()


def test_abort_fans_out_to_every_replica():
    a, b = FakeReplica("a"), FakeReplica("b", running=1)

    async def scenario():
        async with routed(a, b) as router:
            await _generate(router, _request("known"))
            async with grpc.aio.insecure_channel(router.address) as channel:
                return await _stub(channel).Abort(pb.AbortRequest(request_ids=["known", "other"]), timeout=5)

    response = asyncio.run(scenario())
    assert a.aborted == ["known", "other"] and b.aborted == ["known", "other"]
    assert list(response.aborted_request_ids) == ["known"]


def test_abort_of_ids_no_replica_knows_is_not_found():
    a, b = FakeReplica("a"), FakeReplica("b")

    async def scenario():
        async with routed(a, b) as router:
            async with grpc.aio.insecure_channel(router.address) as channel:
                await _stub(channel).Abort(pb.AbortRequest(request_ids=["nobody"]), timeout=5)

    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(scenario())
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "nobody" in error.value.details()
    assert a.aborted == ["nobody"] and b.aborted == ["nobody"]


def test_health_follows_the_replicas_and_watch_streams_changes():
    replica = FakeReplica("late")

    async def scenario():
        async with contextlib.AsyncExitStack() as stack:
            replica_health = await stack.enter_async_context(fake_replica(replica, serving=False))
            router = Router(
                RouterConfig(
                    decoders=(replica.address,),
                    poll_interval_s=0.05,
                    grpc=GrpcSettings(host="127.0.0.1", port=0, grace_s=0.2),
                )
            )
            await router.start()
            stack.push_async_callback(router.stop, 0.2)
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(router.address))
            health = health_pb2_grpc.HealthStub(channel)
            check = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(router, _request())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            watch = health.Watch(health_pb2.HealthCheckRequest(service=GENERATOR_SERVICE), timeout=10)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await replica_health.serving()
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()

    asyncio.run(scenario())


@pytest.fixture
def namespace():
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    ns = f"test-{uuid.uuid4().hex}"
    yield ns
    keys = list(client.scan_iter(f"{PREFIX_DIRECTORY_PREFIX}{ns}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_prefers_the_prefix_holder_within_the_load_bound(namespace):
    idle, holder = FakeReplica("idle"), FakeReplica("holder", running=2)
    request = _request("p", tokens=3 * ROUTING_BLOCK_TOKENS)

    async def scenario():
        async with routed(
            idle,
            holder,
            redis=RedisSettings(url=REDIS_URL),
            prefix_namespace=namespace,
            directory_timeout_s=1.0,
            load_slack=4,
            load_slack_frac=0.0,
        ) as router:
            import redis.asyncio as aioredis

            client = aioredis.from_url(REDIS_URL)
            directory = PrefixDirectory(client, namespace, ttl_s=60)
            await directory.publish(holder.address, request_prefix_hashes(request)[:2])
            await directory.publish(idle.address, request_prefix_hashes(request)[:1])
            stale_key = prefix_directory_key(request_prefix_hashes(request)[0], namespace)
            await client.hset(stale_key, "10.9.9.9:1", 1)  # expired long ago: ignored
            assert 0 < await client.ttl(stale_key) <= 60
            assert await directory.lookup(request_prefix_hashes(request)) == {holder.address: 2, idle.address: 1}
            first = await _generate(router, request)
            holder.running = 50  # far beyond the bound: affinity yields to load
            await asyncio.sleep(0.3)
            second = await _generate(router, request)
            await client.aclose()
            return first[0].delta.text, second[0].delta.text

    assert asyncio.run(scenario()) == ("holder", "idle")


def test_router_imports_no_model_or_media_libraries():
    # The router image ships only the gRPC / Redis / Prometheus clients.
    code = (
        "import sys, decode_service.router, tools.healthcheck; "
        "print(sorted(m for m in ('torch', 'numpy', 'av', 'PIL', 'tml_renderers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == "[]"


def test_stop_drains_running_streams():
    slow = FakeReplica("slow", mode="slow")

    async def scenario():
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(fake_replica(slow))
            router = Router(
                RouterConfig(
                    decoders=(slow.address,),
                    poll_interval_s=0.05,
                    grpc=GrpcSettings(host="127.0.0.1", port=0, grace_s=5.0),
                )
            )
            await router.start()
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(router.address))
            call = _stub(channel).Generate(_request(), timeout=10)
            assert (await call.read()).delta.text == "slow"
            stopping = asyncio.create_task(router.stop())
            rest = []
            while (response := await call.read()) is not grpc.aio.EOF:
                rest.append(response)
            await stopping
            return rest, await call.code()

    rest, code = asyncio.run(scenario())
    assert code == grpc.StatusCode.OK and rest[-1].final.finish_reason == pb.FINISH_REASON_STOP


def test_metrics_port_binds_the_router_host():
    async def scenario():
        async with routed(FakeReplica("a"), metrics_port=free_port()) as router:
            return router._metrics_server.server.server_address[0]

    assert asyncio.run(scenario()) == "127.0.0.1"


def test_cancelled_and_expired_calls_are_counted_with_the_model_name():
    hang = FakeReplica("hang", mode="hang")

    async def counted(router: Router, code: str) -> float:
        for _ in range(100):
            value = router.metrics.registry.get_sample_value(
                "inkling_router_requests_total", {"model_name": "inkling-tiny", "code": code}
            )
            if value:
                return value
            await asyncio.sleep(0.05)
        return 0.0

    async def scenario():
        async with routed(hang, model_name="inkling-tiny") as router:
            async with grpc.aio.insecure_channel(router.address) as channel:
                call = _stub(channel).Generate(_request("c1"), timeout=20)
                assert (await call.read()).delta.text == "hang"
                call.cancel()
                cancelled = await counted(router, "CANCELLED")
                expiring = _stub(channel).Generate(_request("d1"), timeout=0.5)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in expiring:
                        pass
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                expired = await counted(router, "DEADLINE_EXCEEDED")
                still_cancelled = await counted(router, "CANCELLED")  # the expiry not counted as a cancellation
            return cancelled, expired, still_cancelled

    assert asyncio.run(scenario()) == (1.0, 1.0, 1.0)


def test_an_unavailable_dependency_is_surfaced_without_retry_and_the_replica_stays_routable():
    a, b = FakeReplica("a", mode="encoders_down"), FakeReplica("b", mode="encoders_down")

    async def scenario():
        async with routed(a, b) as router:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(router, _request("m1"))
            healthy = len(router.pool.healthy())
            a.mode = b.mode = "ok"
            out = await _generate(router, _request("t1"))  # no poll needed: nobody was marked down
            return err.value, healthy, out

    error, healthy, out = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "no healthy encoder" in error.details()
    assert len(a.calls + b.calls) == 2 and healthy == 2  # one attempt for m1, then t1
    assert out[-1].HasField("final")
