"""`inkling-epd up`: the docker-compose topology as local processes, and the `Cluster` that runs it.

Start order (each tier waits until every process reports SERVING over `grpc.health.v1`): Redis (reuse
127.0.0.1:6379 if it answers, else a private `redis-server` with `deploy/redis.conf` on a free port, else
none) -> N encoders -> M decode replicas (`--encoders` = the encoder addresses) -> 1 router (`--decoders`).
Stop order is the reverse: SIGTERM a tier, wait for it, SIGKILL stragglers. Logs go to one file per process;
a process that dies or never becomes healthy fails the start with the tail of its log.

`Cluster` is the reusable part (the e2e tests and `tools/demo.py` use it):

    with Cluster(ClusterSpec(checkpoint="artifacts/tiny", encoders=2)) as cluster:
        channel = grpc.insecure_channel(cluster.router_address)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import InklingError
from common.settings import SecuritySettings, security_settings
from tools.healthcheck import check

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
REDIS_CONF = Path(__file__).resolve().with_name("redis.conf")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ROLES = ("encoder", "decode", "router", "api")


class ClusterError(InklingError):
    """A cluster process failed to start or died; the message names it and carries its log tail."""


@dataclass(frozen=True)
class ClusterSpec:
    checkpoint: str
    encoders: int = 1
    decoders: int = 1
    base_port: int = 0  # 0: free ports; else router = base, decoders base+1.., encoders after them
    redis: str = "auto"  # "auto" (reuse local, else start one, else none), "none", or a redis:// URL
    device: str = "cpu"
    dtype: str = "bfloat16"
    host: str = "127.0.0.1"
    log_dir: str | None = None  # None: a fresh temporary directory
    startup_timeout_s: float = 300.0  # per tier (model loading dominates)
    stop_timeout_s: float = 20.0  # per tier, before SIGKILL
    grace_seconds: float = 5.0  # passed to every server's --grace-seconds
    extra_args: Mapping[str, Sequence[str]] = field(default_factory=dict)  # role -> more flags
    security_flags: Sequence[str] = ()  # token / TLS flags given to every server (common.settings)
    security: SecuritySettings = field(default_factory=SecuritySettings)  # how the launcher dials them
    commands: Mapping[str, Sequence[str]] = field(default_factory=dict)  # role -> argv prefix override
    api_port: int | None = None  # the OpenAI-compatible HTTP front in front of the router (0: a free port)

    def __post_init__(self) -> None:
        if self.encoders < 0 or self.decoders < 1:
            raise ClusterError(f"need >= 0 encoders and >= 1 decoder, got {self.encoders}, {self.decoders}")
        unknown = (set(self.extra_args) | set(self.commands)) - set(ROLES)
        if unknown:
            raise ClusterError(f"unknown roles {sorted(unknown)}; expected {ROLES}")

    def command(self, role: str) -> list[str]:
        return [*self.commands.get(role, (sys.executable, "-m", "tools.cli")), role]


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    address: str | None  # gRPC address to health-check, None for Redis
    popen: subprocess.Popen | None = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def exited(self) -> bool:
        return self.popen is not None and self.popen.poll() is not None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_reachable(url: str, timeout_s: float = 0.5) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Cluster:
    """Redis + encoders + decode replicas + router as child processes; a context manager."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="inkling-up-"))
        self.redis_url: str | None = None
        self.encoders: list[ManagedProcess] = []
        self.decoders: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None
        self.api: ManagedProcess | None = None  # address: the HTTP front's host:port
        self._redis: ManagedProcess | None = None
        self._ports = iter(range(spec.base_port, spec.base_port + 1 + spec.decoders + spec.encoders))
        self._taken: set[int] = set()

    # -- addresses ----------------------------------------------------------------------------------------

    @property
    def router_address(self) -> str:
        assert self.router is not None and self.router.address is not None, "cluster not started"
        return self.router.address

    @property
    def encoder_addresses(self) -> list[str]:
        return [p.address for p in self.encoders if p.address]

    @property
    def decoder_addresses(self) -> list[str]:
        return [p.address for p in self.decoders if p.address]

    def processes(self) -> list[ManagedProcess]:
        tiers = [
            [self._redis] if self._redis else [],
            self.encoders,
            self.decoders,
            [self.router] if self.router else [],
            [self.api] if self.api else [],
        ]
        return [p for tier in tiers for p in tier]

    # -- start / stop ----------------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Cluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.redis_url = self._start_redis()
            self._start_servers()
        except BaseException:
            self.stop()
            raise
        log.info(
            "cluster up: router %s, redis %s, logs in %s", self.router_address, self.redis_url or "(none)", self.log_dir
        )
        return self

    def _next_port(self) -> int:
        if self.spec.base_port:
            return next(self._ports)
        while (port := free_port(self.spec.host)) in self._taken:
            pass
        self._taken.add(port)
        return port

    def _start_redis(self) -> str | None:
        choice = self.spec.redis
        if choice == "none":
            return None
        if choice != "auto":
            if not redis_reachable(choice):
                log.warning("Redis at %s does not answer yet; services treat it as a cache miss", choice)
            return choice
        if redis_reachable(DEFAULT_REDIS_URL):
            return DEFAULT_REDIS_URL
        server = shutil.which("redis-server")
        if server is None:
            log.warning(
                "no Redis at 127.0.0.1:6379 and no redis-server installed: running without Redis "
                "(no shared embedding cache, no prefix directory)"
            )
            return None
        port = free_port(self.spec.host)
        self._redis = self._spawn(
            "redis",
            [server, str(REDIS_CONF), "--bind", self.spec.host, "--port", str(port), "--maxmemory", "512mb"],
            address=None,
        )
        url = f"redis://{self.spec.host}:{port}/0"
        deadline = time.monotonic() + 10.0
        while not redis_reachable(url):
            if self._redis.exited() or time.monotonic() > deadline:
                raise ClusterError(f"redis-server did not start; log tail:\n{self._redis.log_tail()}")
            time.sleep(0.1)
        return url

    def _server_args(self, port: int) -> list[str]:
        args = ["--host", self.spec.host, "--port", str(port), "--grace-seconds", str(self.spec.grace_seconds)]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        return [*args, *self.spec.security_flags]

    def _start_servers(self) -> None:
        spec = self.spec
        ports = {
            "router": self._next_port(),
            "decode": [self._next_port() for _ in range(spec.decoders)],
            "encoder": [self._next_port() for _ in range(spec.encoders)],
        }
        model_args = ["--checkpoint", spec.checkpoint, "--device", spec.device, "--dtype", spec.dtype]
        for i, port in enumerate(ports["encoder"]):
            self.encoders.append(self._spawn_server(f"encoder-{i}", "encoder", port, model_args))
        self._wait_serving(self.encoders)
        encoders = ",".join(self.encoder_addresses)
        for i, port in enumerate(ports["decode"]):
            address = f"{spec.host}:{port}"
            args = [*model_args, "--encoders", encoders, "--replica-id", address]
            if not encoders:
                args.append("--local-encode")
            self.decoders.append(self._spawn_server(f"decode-{i}", "decode", port, args))
        self._wait_serving(self.decoders)
        self.router = self._spawn_server(
            "router", "router", ports["router"], ["--decoders", ",".join(self.decoder_addresses)]
        )
        self._wait_serving([self.router])
        if spec.api_port is not None:
            self._start_api(spec.api_port or free_port(spec.host))

    def _start_api(self, port: int) -> None:
        """`inkling-epd api` in front of the router (upstream token / TLS flags as the servers got them);
        ready when its /health answers 200."""
        argv = [*self.spec.command("api"), "--upstream", self.router_address, "--host", self.spec.host]
        argv += ["--port", str(port), *self.spec.security_flags, *self.spec.extra_args.get("api", ())]
        self.api = self._spawn("api", argv, address=f"{self.spec.host}:{port}")
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while not http_ok(f"http://{self.api.address}/health"):
            if self.api.exited() or time.monotonic() > deadline:
                raise ClusterError(f"api did not become healthy; log {self.api.log_path}:\n{self.api.log_tail()}")
            time.sleep(0.2)

    def _spawn_server(self, name: str, role: str, port: int, args: list[str]) -> ManagedProcess:
        extra = self.spec.extra_args.get(role, ())
        argv = [*self.spec.command(role), *self._server_args(port), *args, *extra]
        return self._spawn(name, argv, address=f"{self.spec.host}:{port}")

    def _spawn(self, name: str, argv: list[str], address: str | None) -> ManagedProcess:
        process = ManagedProcess(name, argv, self.log_dir / f"{name}.log", address)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(process.log_path, "wb") as log_file:
            guarded = [sys.executable, "-m", "deploy.exit_with_parent", str(os.getpid()), *argv]
            process.popen = subprocess.Popen(
                guarded,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        log.info("started %s (pid %d, %s)", name, process.popen.pid, address or "no gRPC")
        return process

    def _wait_serving(self, processes: Sequence[ManagedProcess]) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        pending = list(processes)
        while pending:
            for process in list(pending):
                if process.exited():
                    raise ClusterError(
                        f"{process.name} exited with code {process.popen.returncode} before "
                        f"reporting SERVING; log {process.log_path}:\n{process.log_tail()}"
                    )
                if check(process.address, timeout_s=1.0, security=self.spec.security) == "SERVING":
                    pending.remove(process)
            if pending and time.monotonic() > deadline:
                process = pending[0]
                raise ClusterError(
                    f"{process.name} ({process.address}) not SERVING after "
                    f"{self.spec.startup_timeout_s:.0f} s; log {process.log_path}:\n"
                    f"{process.log_tail()}"
                )
            if pending:
                time.sleep(0.2)

    def dead(self) -> list[ManagedProcess]:
        """Processes that have exited (a running cluster should have none)."""
        return [p for p in self.processes() if p.exited()]

    def stop(self) -> None:
        """Tier by tier, router first: SIGTERM, wait, SIGKILL what is left. Safe to call twice."""
        tiers = [
            [self.api] if self.api else [],
            [self.router] if self.router else [],
            self.decoders,
            self.encoders,
            [self._redis] if self._redis else [],
        ]
        for tier in tiers:
            running = [p for p in tier if p.popen is not None and p.popen.poll() is None]
            for process in running:
                with contextlib.suppress(ProcessLookupError):
                    process.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.spec.stop_timeout_s
            for process in running:
                try:
                    process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning(
                        "killing %s: still running %.0f s after SIGTERM", process.name, self.spec.stop_timeout_s
                    )
                    process.popen.kill()
                    process.popen.wait()


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # one stop is enough: let it finish undisturbed
        signal.signal(sig, signal.SIG_IGN)
    raise _Terminated


def security_flags(args: argparse.Namespace) -> list[str]:
    """The token / TLS flags of `inkling-epd up`, to pass on to every server it starts."""
    flags = []
    for name in ("auth_token_file", "auth_token", "tls_cert", "tls_key", "tls_ca"):
        value = getattr(args, name, None)
        if value:
            flags += [f"--{name.replace('_', '-')}", value]
    return flags


def main(args: argparse.Namespace) -> int:
    """`inkling-epd up`: start the cluster, print the router address, run until Ctrl-C / SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    spec = ClusterSpec(
        checkpoint=args.checkpoint,
        encoders=args.encoders,
        decoders=args.decoders,
        base_port=args.base_port,
        redis=args.redis_url or "auto",
        device=args.device,
        dtype=args.dtype,
        security_flags=security_flags(args),
        security=security_settings(args),
        api_port=args.api_port,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_terminated)
    cluster = Cluster(spec)
    try:
        with cluster:
            print(f"router: {cluster.router_address}")
            if cluster.api is not None:
                print(f"openai api: http://{cluster.api.address}/v1")
            print(f"decoders: {', '.join(cluster.decoder_addresses)}")
            print(f"encoders: {', '.join(cluster.encoder_addresses) or '(none)'}")
            print(f"redis: {cluster.redis_url or '(none: no shared cache)'}")
            print(f"logs: {cluster.log_dir}  (Ctrl-C to stop)", flush=True)
            while True:
                dead = cluster.dead()
                if dead:
                    print(
                        f"{dead[0].name} exited with code {dead[0].popen.returncode}; stopping. Log tail:\n"
                        f"{dead[0].log_tail()}",
                        file=sys.stderr,
                    )
                    return 1
                time.sleep(0.5)
    except ClusterError as exc:
        print(f"inkling-epd up: {exc}", file=sys.stderr)
        return 1
    except _Terminated:
        print("stopped", file=sys.stderr)
        return 0
