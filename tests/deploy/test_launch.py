"""`Cluster` with stand-in encoder/decode processes (a tiny gRPC script written here) and the real router."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import time

import grpc
import pytest
import redis

from common.settings import security_settings
from decode_service.router import REPLICA_METADATA_KEY
from deploy import launch
from deploy.launch import Cluster, ClusterError, ClusterSpec, free_port, redis_reachable
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc
from tools.healthcheck import check

FAKE_SERVER = """
import argparse, asyncio, signal, sys
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from proto.inkling_epd.v1 import generator_pb2 as pb, generator_pb2_grpc

class Fake(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, name):
        self.name = name
    async def Generate(self, request, context):
        yield pb.GenerateResponse(delta=pb.Delta(text=self.name))
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP))
    async def GetLoad(self, request, context):
        return pb.Load()

async def run(args):
    server = grpc.aio.server()
    generator_pb2_grpc.add_GeneratorServicer_to_server(Fake(f"{args.role}@{args.port}"), server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    ready = args.fake_mode != "never-ready"
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING if ready else
                       health_pb2.HealthCheckResponse.NOT_SERVING)
    stop = asyncio.Event()
    if args.fake_mode == "ignore-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    print("fake: stopping on SIGTERM", flush=True)
    await server.stop(0)

parser = argparse.ArgumentParser()
parser.add_argument("role")
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--fake-mode", default="ok")
args, _ = parser.parse_known_args()
print("fake argv:", " ".join(sys.argv[1:]), flush=True)
if args.fake_mode == "crash":
    print("boom: cannot load checkpoint", flush=True)
    sys.exit(3)
asyncio.run(run(args))
"""


@pytest.fixture
def fake_spec(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    fake = (sys.executable, str(script))

    def make(**overrides) -> ClusterSpec:
        base = dict(
            checkpoint=str(tmp_path / "ckpt"),
            redis="none",
            log_dir=str(tmp_path / "logs"),
            startup_timeout_s=30.0,
            stop_timeout_s=10.0,
            grace_seconds=0.5,
            commands={"encoder": fake, "decode": fake},
        )
        return ClusterSpec(**{**base, **overrides})

    return make


def test_cluster_starts_every_tier_and_serves_through_the_router(fake_spec, monkeypatch):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    # Pretend no Redis listens on the default address so the cluster starts its own redis-server.
    monkeypatch.setattr(launch, "DEFAULT_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    cluster = Cluster(fake_spec(encoders=2, decoders=2, redis="auto"))
    with cluster:
        assert cluster.redis_url and redis_reachable(cluster.redis_url)
        assert check(cluster.router_address) == "SERVING"
        decode_log = (cluster.log_dir / "decode-1.log").read_text()
        assert f"--encoders {','.join(cluster.encoder_addresses)}" in decode_log
        assert f"--replica-id {cluster.decoder_addresses[1]}" in decode_log
        assert f"--redis-url {cluster.redis_url}" in decode_log
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = generator_pb2_grpc.GeneratorStub(channel)
            call = stub.Generate(pb.GenerateRequest(request_id="x"), timeout=10)
            out = list(call)
            served_by = dict(call.initial_metadata())[REPLICA_METADATA_KEY]
        assert out[0].delta.text.startswith("decode@") and out[-1].HasField("final")
        assert served_by in cluster.decoder_addresses and out[0].delta.text.endswith(served_by.rsplit(":")[1])
        processes = cluster.processes()
        assert len(processes) == 6 and not cluster.dead()
    assert all(p.popen.returncode == 0 for p in processes), [(p.name, p.popen.returncode) for p in processes]
    assert "stopping on SIGTERM" in (cluster.log_dir / "encoder-0.log").read_text()
    assert not redis_reachable(cluster.redis_url)


def test_a_crashing_process_fails_the_start_with_its_log_tail(fake_spec):
    cluster = Cluster(fake_spec(extra_args={"decode": ["--fake-mode", "crash"]}))
    with pytest.raises(ClusterError) as err:
        cluster.start()
    message = str(err.value)
    assert "decode-0 exited with code 3" in message and "boom: cannot load checkpoint" in message
    assert all(p.popen.poll() is not None for p in cluster.processes())  # the encoder was stopped too


def test_a_process_that_never_becomes_healthy_times_out(fake_spec):
    spec = fake_spec(startup_timeout_s=2.0, extra_args={"encoder": ["--fake-mode", "never-ready"]})
    cluster = Cluster(spec)
    with pytest.raises(ClusterError, match=r"encoder-0 \(127\.0\.0\.1:\d+\) not SERVING after 2 s"):
        cluster.start()
    assert cluster.processes() and all(p.popen.poll() is not None for p in cluster.processes())


def test_stop_kills_processes_that_ignore_sigterm(fake_spec):
    spec = fake_spec(stop_timeout_s=0.5, extra_args={"encoder": ["--fake-mode", "ignore-sigterm"]})
    cluster = Cluster(spec)
    with cluster:
        encoder = cluster.encoders[0]
    assert encoder.popen.returncode == -9


def test_spec_validation():
    with pytest.raises(ClusterError, match="unknown roles"):
        ClusterSpec(checkpoint="x", extra_args={"decoder": ["--x"]})
    with pytest.raises(ClusterError, match=">= 1 decoder"):
        ClusterSpec(checkpoint="x", decoders=0)


def test_token_flags_reach_every_server_and_guard_the_router(fake_spec, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    args = argparse.Namespace(
        auth_token_file=str(token_file), auth_token=None, tls_cert=None, tls_key=None, tls_ca=None, tls_server_name=None
    )
    spec = fake_spec(
        encoders=1, decoders=1, security_flags=launch.security_flags(args), security=security_settings(args)
    )
    with Cluster(spec) as cluster:
        for name in ("encoder-0", "decode-0"):  # the fakes print their argv; the real router enforces below
            assert f"--auth-token-file {token_file}" in (cluster.log_dir / f"{name}.log").read_text(), name
        assert check(cluster.router_address) == "SERVING"  # health stays open
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = generator_pb2_grpc.GeneratorStub(channel)
            with pytest.raises(grpc.RpcError) as denied:
                list(stub.Generate(pb.GenerateRequest(request_id="anon"), timeout=10))
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = list(
                stub.Generate(
                    pb.GenerateRequest(request_id="authed"),
                    timeout=10,
                    metadata=[("authorization", "Bearer s3cret-token")],
                )
            )
        assert out[-1].HasField("final")


def test_api_port_puts_the_openai_front_before_the_router(fake_spec):
    import httpx

    spec = fake_spec(api_port=0, extra_args={"api": ["--served-model-name", "fake"]})
    with Cluster(spec) as cluster:
        base = f"http://{cluster.api.address}"
        assert httpx.get(f"{base}/health").status_code == 200
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10).json()
        assert reply["choices"][0]["message"]["content"].startswith("decode@")
        api = cluster.api
        assert api.argv[api.argv.index("--upstream") + 1] == cluster.router_address
    assert api.popen.returncode == 0


def test_a_taken_base_port_fails_the_start_naming_it(fake_spec):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = Cluster(fake_spec(base_port=port))
        with pytest.raises(ClusterError, match=f"gRPC port {port} on 127.0.0.1 is in use"):
            cluster.start()
    assert not cluster.processes()  # nothing was started on a shared port


def test_a_dead_child_is_restarted_with_backoff_and_the_rest_keeps_serving(fake_spec):
    with Cluster(fake_spec(encoders=2)) as cluster:
        victim, survivor = cluster.encoders
        victim.popen.kill()
        victim.popen.wait()
        t0 = time.monotonic()
        assert cluster.restart_dead(now=t0, backoff_s=1.0) == []  # first sighting: scheduled, not started
        assert victim.restart_at == pytest.approx(t0 + 1.0)
        assert cluster.restart_dead(now=t0 + 0.5) == []
        assert cluster.restart_dead(now=t0 + 1.0) == [victim]
        assert not survivor.exited() and check(cluster.router_address) == "SERVING"
        deadline = time.monotonic() + 30
        while check(victim.address, timeout_s=1.0) != "SERVING":
            assert time.monotonic() < deadline, victim.log_tail()
            time.sleep(0.1)
        assert "--- restart 1 by inkling-epd up ---" in victim.log_path.read_text()
        victim.popen.kill()  # a second quick exit doubles the wait
        victim.popen.wait()
        now = time.monotonic()
        assert cluster.restart_dead(now=now, backoff_s=1.0) == []
        assert victim.restarts == 2 and victim.restart_at == pytest.approx(now + 2.0)


def test_up_passes_metrics_ports_redis_prefix_and_role_flags_through(fake_spec):
    parser = argparse.ArgumentParser()
    launch.add_up_args(parser)
    args = parser.parse_args(
        ["--checkpoint", "x", "--redis-prefix", "--log-level", "debug", "--decode-args", "--max-num-seqs 8"]
    )
    extra = launch.extra_args(args)
    assert extra["decode"] == ["--max-num-seqs", "8", "--log-level", "DEBUG", "--redis-prefix"]
    assert extra["router"] == ["--log-level", "DEBUG"]
    metrics = free_port()
    spec = fake_spec(encoders=1, metrics_base_port=metrics, extra_args={"decode": extra["decode"]})
    with Cluster(spec) as cluster:
        decode_log = (cluster.log_dir / "decode-0.log").read_text()
        assert f"--metrics-port {metrics + 1}" in decode_log and "--max-num-seqs 8" in decode_log
        assert "--redis-prefix" in decode_log
        assert f"--metrics-port {metrics + 2}" in (cluster.log_dir / "encoder-0.log").read_text()
        assert f"--metrics-port {metrics}" in " ".join(cluster.router.argv)
        assert "--model-name ckpt" in " ".join(cluster.router.argv)  # the decoders' default model id


def test_bad_role_flags_and_redis_choice_are_named():
    parser = argparse.ArgumentParser()
    launch.add_up_args(parser)
    with pytest.raises(ClusterError, match="--router-args"):
        launch.extra_args(parser.parse_args(["--checkpoint", "x", "--router-args", "'unclosed"]))
    with pytest.raises(ClusterError, match="redis: expected auto, private, none"):
        ClusterSpec(checkpoint="x", redis="localhost:6379")


def test_private_redis_is_started_even_when_one_answers_locally(fake_spec):
    if shutil.which("redis-server") is None or not redis_reachable(launch.DEFAULT_REDIS_URL):
        pytest.skip("needs redis-server and a Redis on 127.0.0.1:6379")
    with Cluster(fake_spec(redis="private")) as cluster:
        assert cluster.redis_url != launch.DEFAULT_REDIS_URL and redis_reachable(cluster.redis_url)
        assert cluster.redis_origin.startswith("private")
        assert redis.Redis.from_url(cluster.redis_url).dbsize() == 0  # a cold start
    reused = Cluster(fake_spec(redis="auto"))
    with reused:
        assert reused.redis_url == launch.DEFAULT_REDIS_URL and reused.redis_origin.startswith("reused")


def test_up_passes_tensor_and_expert_parallel_flags_to_every_decode_replica(fake_spec):
    parser = argparse.ArgumentParser()
    launch.add_up_args(parser)
    args = parser.parse_args(["--checkpoint", "x", "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert (args.tensor_parallel_size, args.enable_expert_parallel) == (2, True)
    spec = fake_spec(decoders=2, encoders=0, tensor_parallel_size=2, expert_parallel=True)
    with Cluster(spec) as cluster:
        for process in cluster.decoders:
            assert "--tensor-parallel-size 2 --enable-expert-parallel" in " ".join(process.argv)
            assert process.env == {}  # --device cpu: gloo ranks, no GPUs to hand out
        assert "--tensor-parallel-size" not in " ".join(cluster.router.argv)


def test_tensor_parallel_replicas_get_disjoint_gpus(monkeypatch):
    spec = ClusterSpec(checkpoint="x", decoders=2, device="cuda", tensor_parallel_size=4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [spec.decode_gpus(i) for i in range(2)] == ["0,1,2,3", "4,5,6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    assert [spec.decode_gpus(i) for i in range(2)] == ["7,6,5,4", "3,2,1,0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ClusterError, match="need 8 GPUs, CUDA_VISIBLE_DEVICES has 3"):
        spec.decode_gpus(0)
    one = ClusterSpec(checkpoint="x", decoders=1, device="cuda", tensor_parallel_size=2)
    assert one.decode_gpus(0) is None  # one replica: it uses GPUs 0..N-1 of what it inherits


def test_bad_parallel_flags_are_named():
    with pytest.raises(ClusterError, match="--tensor-parallel-size must be >= 1, got 0"):
        ClusterSpec(checkpoint="x", tensor_parallel_size=0)
    with pytest.raises(ClusterError, match="--enable-expert-parallel needs --tensor-parallel-size > 1"):
        ClusterSpec(checkpoint="x", expert_parallel=True)
    with pytest.raises(ClusterError, match="both as an `up` flag and in --decode-args"):
        ClusterSpec(checkpoint="x", tensor_parallel_size=2, extra_args={"decode": ["--tensor-parallel-size", "4"]})
    parser = argparse.ArgumentParser()
    launch.add_up_args(parser)
    args = parser.parse_args(["--checkpoint", "x", "--enable-expert-parallel"])
    assert launch.main(args) == 2  # the spec error, before anything starts


def test_a_tensor_parallel_replica_started_by_up_serves_the_single_process_tokens(tmp_path, capsys):
    """A real decode replica of 2 gloo ranks (make-tiny checkpoint, no encoder tier) behind the router returns the
    greedy tokens of `generate --local` in one process."""
    from tools.cli import main as cli_main
    from tools.make_tiny_checkpoint import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", nvfp4=False, seed=3)
    prompt = [200000, 200004, 9906, 11, 1917, 200010] * 3
    argv = ["generate", "--local", "--checkpoint", str(checkpoint), "--dtype", "float32", "--json"]
    flags = ["--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "8", "--ignore-eos"]
    assert cli_main([*argv, *flags]) == 0
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    spec = ClusterSpec(
        checkpoint=str(checkpoint),
        encoders=0,
        redis="none",
        dtype="float32",
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=120.0,
        stop_timeout_s=15.0,
        grace_seconds=0.5,
        tensor_parallel_size=2,
    )
    request = pb.GenerateRequest(
        request_id="tp2-up",
        tokens=pb.TokenPrompt(token_ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )
    with Cluster(spec) as cluster:
        assert "--tensor-parallel-size 2" in " ".join(cluster.decoders[0].argv)
        with grpc.insecure_channel(cluster.router_address) as channel:
            responses = list(generator_pb2_grpc.GeneratorStub(channel).Generate(request, timeout=60))
    assert responses[-1].WhichOneof("response") == "final"
    assert [t for r in responses[:-1] for t in r.delta.token_ids] == expected and len(expected) == 8
