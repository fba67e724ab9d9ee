"""`inkling-epd up`: the docker-compose topology as local processes, and the `Cluster` that runs it.

Start order (each tier waits until every process reports SERVING over `grpc.health.v1`): Redis ("auto": reuse
127.0.0.1:6379 if it answers, else a private `redis-server` with `deploy/redis.conf` on a free port, else
none; "private": always a private one) -> N encoders -> M decode replicas (`--encoders` = the encoder
addresses) -> 1 router (`--decoders`). Stop order is the reverse: SIGTERM a tier, wait for it, SIGKILL
stragglers. Logs go to one file per process; a process that dies or never becomes healthy fails the start with
the tail of its log. With a base port, a port that is already taken fails the start naming it.

Once up, `inkling-epd up` supervises like compose's `restart: unless-stopped`: a child that exits is started
again on its own port with its own argv (`Cluster.restart_dead`), after a backoff that doubles per quick
exit; the rest of the cluster keeps serving.

`Cluster` is the reusable part (the e2e tests and `tools/demo.py` use it):

    with Cluster(ClusterSpec(checkpoint="artifacts/tiny", encoders=2)) as cluster:
        channel = grpc.insecure_channel(cluster.router_address)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
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
    redis: str = "auto"  # "auto" (reuse local, else start one, else none), "private", "none", or a redis:// URL
    device: str = "cpu"
    dtype: str = "bfloat16"
    host: str = "127.0.0.1"
    log_dir: str | None = None  # None: a fresh temporary directory
    startup_timeout_s: float = 300.0  # per tier (model loading dominates)
    stop_timeout_s: float = 20.0  # per tier, before SIGKILL
    grace_seconds: float = 5.0  # passed to every server's --grace-seconds
    metrics_base_port: int = 0  # 0: no /metrics; else router = base, decoders base+1.., encoders after them
    extra_args: Mapping[str, Sequence[str]] = field(default_factory=dict)  # role -> more flags
    security_flags: Sequence[str] = ()  # token / TLS flags given to every server (common.settings)
    security: SecuritySettings = field(default_factory=SecuritySettings)  # how the launcher dials them
    commands: Mapping[str, Sequence[str]] = field(default_factory=dict)  # role -> argv prefix override
    api_port: int | None = None  # the OpenAI-compatible HTTP front in front of the router (0: a free port)
    tensor_parallel_size: int = 1  # ranks (GPUs) per decode replica, passed to every `decode`
    expert_parallel: bool = False  # the replicas partition the routed experts over their ranks

    def __post_init__(self) -> None:
        if self.encoders < 0 or self.decoders < 1:
            raise ClusterError(f"need >= 0 encoders and >= 1 decoder, got {self.encoders}, {self.decoders}")
        unknown = (set(self.extra_args) | set(self.commands)) - set(ROLES)
        if unknown:
            raise ClusterError(f"unknown roles {sorted(unknown)}; expected {ROLES}")
        if self.redis not in ("auto", "private", "none") and not self.redis.startswith(("redis://", "rediss://")):
            raise ClusterError(f"redis: expected auto, private, none or a redis:// URL, got {self.redis!r}")
        if self.tensor_parallel_size < 1:
            raise ClusterError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ClusterError("--enable-expert-parallel needs --tensor-parallel-size > 1")
        given = {"--tensor-parallel-size", "--enable-expert-parallel"} & set(self.extra_args.get("decode", ()))
        if given and (self.tensor_parallel_size > 1 or self.expert_parallel):
            raise ClusterError(f"{sorted(given)} given both as an `up` flag and in --decode-args: give it once")

    def decode_gpus(self, replica: int) -> str | None:
        """CUDA_VISIBLE_DEVICES of decode replica `replica` when several tensor-parallel replicas share the host
        (GPUs `replica * N .. replica * N + N - 1` of the launcher's visible ones), else None (inherited)."""
        if self.tensor_parallel_size == 1 or self.decoders == 1 or not self.device.startswith("cuda"):
            return None
        n = self.tensor_parallel_size
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(g) for g in range(self.decoders * n)]
        if len(gpus) < self.decoders * n:
            raise ClusterError(
                f"{self.decoders} decode replicas x --tensor-parallel-size {n} need {self.decoders * n} GPUs, "
                f"CUDA_VISIBLE_DEVICES has {len(gpus)}"
            )
        return ",".join(gpus[replica * n : (replica + 1) * n])

    def parallel_args(self) -> list[str]:
        """The tensor / expert parallel flags of every decode replica."""
        args = ["--tensor-parallel-size", str(self.tensor_parallel_size)] if self.tensor_parallel_size > 1 else []
        return [*args, "--enable-expert-parallel"] if self.expert_parallel else args

    def command(self, role: str) -> list[str]:
        return [*self.commands.get(role, (sys.executable, "-m", "tools.cli")), role]


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    address: str | None  # gRPC address to health-check, None for Redis
    popen: subprocess.Popen | None = None
    started_at: float = 0.0  # time.monotonic() of the last start
    restarts: int = 0
    restart_at: float | None = None  # when a dead process is due to be started again
    env: Mapping[str, str] = field(default_factory=dict)  # set over the launcher's environment

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


def ensure_port_free(host: str, port: int, what: str) -> None:
    """Raise `ClusterError` naming `port` when something listens on it (servers bind exclusively)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ClusterError(
                f"{what} port {port} on {host} is in use ({exc.strerror}): is another cluster running? "
                "Stop it or pick another base port"
            ) from None


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
        self._metrics_ports = iter(
            range(spec.metrics_base_port, spec.metrics_base_port + 1 + spec.decoders + spec.encoders)
        )
        self._taken: set[int] = set()
        self._metrics_by_port: dict[int, int] = {}
        self.redis_origin = ""  # how `redis_url` was chosen, for the operator: given, reused, private, none

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
            port = next(self._ports)
            ensure_port_free(self.spec.host, port, "gRPC")
            return port
        while (port := free_port(self.spec.host)) in self._taken:
            pass
        self._taken.add(port)
        return port

    def _start_redis(self) -> str | None:
        choice = self.spec.redis
        if choice == "none":
            self.redis_origin = "none"
            return None
        if choice not in ("auto", "private"):
            self.redis_origin = "given"
            if not redis_reachable(choice):
                log.warning("Redis at %s does not answer yet; services treat it as a cache miss", choice)
            return choice
        if choice == "auto" and redis_reachable(DEFAULT_REDIS_URL):
            self.redis_origin = "reused: it already answered there; its caches may be warm"
            log.warning("reusing the Redis already listening at %s (shared caches)", DEFAULT_REDIS_URL)
            return DEFAULT_REDIS_URL
        server = shutil.which("redis-server")
        if server is None:
            self.redis_origin = "none"
            log.warning(
                "no %sredis-server installed: running without Redis (no shared embedding cache, no prefix directory)",
                "Redis at 127.0.0.1:6379 and no " if choice == "auto" else "",
            )
            return None
        self.redis_origin = "private: started for this cluster, empty"
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
        if port in self._metrics_by_port:
            args += ["--metrics-port", str(self._metrics_by_port[port])]
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
        self._metrics_by_port = {}
        if spec.metrics_base_port:
            for port in [ports["router"], *ports["decode"], *ports["encoder"]]:
                self._metrics_by_port[port] = next(self._metrics_ports)
                ensure_port_free(spec.host, self._metrics_by_port[port], "metrics")
        model_args = ["--checkpoint", spec.checkpoint, "--device", spec.device, "--dtype", spec.dtype]
        for i, port in enumerate(ports["encoder"]):
            self.encoders.append(self._spawn_server(f"encoder-{i}", "encoder", port, model_args))
        self._wait_serving(self.encoders)
        encoders = ",".join(self.encoder_addresses)
        for i, port in enumerate(ports["decode"]):
            address = f"{spec.host}:{port}"
            args = [*model_args, "--encoders", encoders, "--replica-id", address, *spec.parallel_args()]
            if not encoders:
                args.append("--local-encode")
            gpus = spec.decode_gpus(i)
            env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus}
            self.decoders.append(self._spawn_server(f"decode-{i}", "decode", port, args, env))
        self._wait_serving(self.decoders)
        # the decode replicas serve the checkpoint directory's name as their model id: label the router alike
        model_name = Path(spec.checkpoint).resolve().name
        router_args = ["--decoders", ",".join(self.decoder_addresses), "--model-name", model_name]
        self.router = self._spawn_server("router", "router", ports["router"], router_args)
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

    def _spawn_server(
        self, name: str, role: str, port: int, args: list[str], env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        extra = self.spec.extra_args.get(role, ())
        argv = [*self.spec.command(role), *self._server_args(port), *args, *extra]
        return self._spawn(name, argv, address=f"{self.spec.host}:{port}", env=env)

    def _spawn(
        self, name: str, argv: list[str], address: str | None, env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        process = ManagedProcess(name, argv, self.log_dir / f"{name}.log", address, env=dict(env or {}))
        self._popen(process, "wb")
        log.info("started %s (pid %d, %s)", name, process.popen.pid, address or "no gRPC")
        return process

    def _popen(self, process: ManagedProcess, mode: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **process.env}
        with open(process.log_path, mode) as log_file:
            guarded = [sys.executable, "-m", "deploy.exit_with_parent", str(os.getpid()), *process.argv]
            process.popen = subprocess.Popen(
                guarded,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process.started_at = time.monotonic()
        process.restart_at = None

    def restart_dead(
        self, now: float | None = None, backoff_s: float = 1.0, max_backoff_s: float = 30.0, stable_s: float = 60.0
    ) -> list[ManagedProcess]:
        """Compose's restart policy: schedule each newly dead process for a restart after a backoff that
        doubles with every exit within `stable_s` of its start (up to `max_backoff_s`), and start those that are
        due, on their own ports with their own argv (the log file is appended to). Returns the restarted ones."""
        now = time.monotonic() if now is None else now
        restarted = []
        for process in self.dead():
            if process.restart_at is None:
                quick = now - process.started_at < stable_s
                process.restarts = process.restarts + 1 if quick else 1
                delay = min(max_backoff_s, backoff_s * 2 ** (process.restarts - 1))
                process.restart_at = now + delay
                log.warning(
                    "%s exited with code %s; restarting in %.1f s. Log tail:\n%s",
                    process.name,
                    process.popen.returncode,
                    delay,
                    process.log_tail(),
                )
            elif now >= process.restart_at:
                with open(process.log_path, "ab") as log_file:
                    log_file.write(f"--- restart {process.restarts} by inkling-epd up ---\n".encode())
                self._popen(process, "ab")
                log.warning("restarted %s (pid %d, restart %d)", process.name, process.popen.pid, process.restarts)
                restarted.append(process)
        return restarted

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


def add_up_args(up: argparse.ArgumentParser) -> None:
    """The flags of `inkling-epd up`."""
    from common.settings import add_security_args

    up.add_argument("--checkpoint", required=True)
    up.add_argument("--encoders", type=int, default=1)
    up.add_argument("--decoders", type=int, default=1)
    up.add_argument("--base-port", type=int, default=50050, help="router port; decoders, then encoders follow it")
    up.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="first Prometheus port, laid out like --base-port (router, decoders, encoders); 0 = off",
    )
    up.add_argument(
        "--redis-url",
        default=None,
        help="redis:// URL, 'private' (start an empty redis-server) or 'none' "
        "(default: reuse 127.0.0.1:6379 if it answers, else private)",
    )
    up.add_argument("--redis-prefix", action="store_true", help="decode replicas share KV prefixes through Redis")
    up.add_argument(
        "--api-port", type=int, default=None, help="also start the OpenAI HTTP front here (0 = any free port)"
    )
    up.add_argument("--device", default="cpu")
    up.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    up.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks per decode replica: one GPU each with --device cuda (replica i of several gets GPUs "
        "i*N..i*N+N-1 of the visible ones), gloo processes with --device cpu",
    )
    up.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="decode replicas partition the routed experts over their ranks (needs --tensor-parallel-size > 1)",
    )
    up.add_argument("--grace-seconds", type=float, default=10.0, help="every server's drain time on SIGTERM")
    up.add_argument("--log-level", default=None, type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    for role in ROLES:
        up.add_argument(
            f"--{role}-args",
            default="",
            metavar="FLAGS",
            help=f"more flags for every {role}, as one shell-quoted string (e.g. --{role}-args='--max-wait-ms 2')",
        )
    add_security_args(up, max_streams_per_client=None)  # passed on to every server


def extra_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """Per-role flags of `inkling-epd up` for the servers it starts."""
    extra: dict[str, list[str]] = {}
    for role in ROLES:
        text = getattr(args, f"{role}_args", "") or ""
        try:
            extra[role] = shlex.split(text)
        except ValueError as exc:
            raise ClusterError(f"--{role}-args: {exc}: {text!r}") from None
        if getattr(args, "log_level", None):
            extra[role] += ["--log-level", args.log_level]
    if getattr(args, "redis_prefix", False):
        extra["decode"].append("--redis-prefix")
    return extra


def main(args: argparse.Namespace) -> int:
    """`inkling-epd up`: start the cluster, print the router address, run until Ctrl-C / SIGTERM, starting
    children that die again (with backoff) instead of stopping the cluster."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        spec = ClusterSpec(
            checkpoint=args.checkpoint,
            encoders=args.encoders,
            decoders=args.decoders,
            base_port=args.base_port,
            metrics_base_port=getattr(args, "metrics_port", 0) or 0,
            redis=args.redis_url or "auto",
            device=args.device,
            dtype=args.dtype,
            grace_seconds=getattr(args, "grace_seconds", 10.0),
            extra_args=extra_args(args),
            security_flags=security_flags(args),
            security=security_settings(args),
            api_port=args.api_port,
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            expert_parallel=getattr(args, "enable_expert_parallel", False),
        )
    except ClusterError as exc:
        print(f"inkling-epd up: {exc}", file=sys.stderr)
        return 2
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
            print(f"redis: {cluster.redis_url or '(none: no shared cache)'} ({cluster.redis_origin})")
            if spec.metrics_base_port:
                print(f"metrics: ports {spec.metrics_base_port}.. (router, decoders, encoders)")
            print(f"logs: {cluster.log_dir}  (Ctrl-C to stop)", flush=True)
            while True:
                for process in cluster.restart_dead():
                    print(f"restarted {process.name} (restart {process.restarts})", file=sys.stderr, flush=True)
                time.sleep(0.5)
    except ClusterError as exc:
        print(f"inkling-epd up: {exc}", file=sys.stderr)
        return 1
    except _Terminated:
        print("stopped", file=sys.stderr)
        return 0
