"""Typed service settings, built from CLI flags; the only module that reads environment variables.

Environment variables (a deliberately short list; each fails loudly on a bad value):
  INKLING_REDIS_URL         default Redis URL for the shared caches when --redis-url is not given
  INKLING_REDIS_KEY_PREFIX  key prefix of the embedding cache (default "ink:emb:")
  INKLING_LOG_LEVEL         default log level when --log-level is not given
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from common.errors import ConfigError
from common.targets import parse_targets

# Explicit gRPC limits (never the 4 MiB default): responses are streamed in <= 1 MiB chunks, so 8 MiB on a
# response fails loudly on a bug; requests carry inline media, so they get a larger bound.
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20
DEFAULT_MAX_REQUEST_BYTES = 160 << 20
MIB = 1 << 20
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DTYPE_NAMES = ("float32", "bfloat16")  # model compute dtypes the services accept (torch names: `common.dtypes`)


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def env_redis_url() -> str | None:
    return env_str("INKLING_REDIS_URL")


def env_log_level() -> str:
    level = (env_str("INKLING_LOG_LEVEL", "INFO") or "INFO").upper()
    if level not in _LOG_LEVELS:
        raise ConfigError(f"INKLING_LOG_LEVEL={level!r} is not one of {_LOG_LEVELS}")
    return level


def _positive(where: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


@dataclass(frozen=True)
class RedisSettings:
    url: str
    key_prefix: str = "ink:emb:"
    timeout_s: float = 0.25  # connect and per-operation timeout; a slow Redis is a miss, not a stall
    ttl_s: int | None = None  # None: rely on maxmemory + allkeys-lru
    async_writes: bool = True
    max_value_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        scheme = urlparse(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"redis url {self.url!r}: expected a redis://, rediss:// or unix:// URL")
        _positive("redis timeout_s", self.timeout_s)
        if self.ttl_s is not None:
            _positive("redis ttl_s", self.ttl_s)


@dataclass(frozen=True)
class SecuritySettings:
    """Optional transport security (see `common.auth`): a shared bearer token and/or (m)TLS from PEM files.

    The token protects every RPC except `grpc.health.v1`; `tls_ca` set on a server requires client
    certificates signed by it (mTLS). Clients use the same settings to dial our servers.
    """

    token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None  # PEM certificate chain of this process (server cert; client cert for mTLS)
    tls_key: str | None = None  # PEM private key of `tls_cert`
    tls_ca: str | None = None  # PEM CA bundle: verifies peers (servers require client certs when set)
    tls_server_name: str | None = None  # clients: expected name in the server certificate, if not the host
    max_streams_per_client: int = 0  # servers: concurrent calls per client address (0: unlimited)

    def __post_init__(self) -> None:
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ConfigError("auth token must be non-empty and contain no whitespace")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key must be given together")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"--{name.replace('_', '-')}={path!r} is not a readable file")
        _positive("--max-streams-per-client", self.max_streams_per_client, allow_zero=True)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None or self.tls_ca is not None


def add_security_args(parser: argparse.ArgumentParser, max_streams_per_client: int | None = 0) -> None:
    """Flags of `SecuritySettings` (every serve command; clients that dial our servers too, with
    `max_streams_per_client=None`: no server-side flag)."""
    parser.add_argument(
        "--auth-token-file",
        default=None,
        help="file holding the shared bearer token required on every RPC except health",
    )
    parser.add_argument(
        "--auth-token", default=None, help="the token itself (visible in the process list; prefer --auth-token-file)"
    )
    parser.add_argument("--tls-cert", default=None, help="PEM certificate (enables TLS)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle; servers then require client certs (mTLS)")
    parser.add_argument("--tls-server-name", default=None, help="expected server certificate name (clients)")
    if max_streams_per_client is not None:
        parser.add_argument(
            "--max-streams-per-client",
            type=int,
            default=max_streams_per_client,
            help="concurrent calls accepted per client address; more get RESOURCE_EXHAUSTED (0 = unlimited)",
        )


def read_token_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--auth-token-file={path!r}: cannot read the token ({exc})") from None


def security_settings(args: argparse.Namespace) -> SecuritySettings:
    """`SecuritySettings` from the flags of `add_security_args` (all optional: absent flags mean off)."""
    token_file = getattr(args, "auth_token_file", None)
    token = getattr(args, "auth_token", None)
    if token_file and token:
        raise ConfigError("give either --auth-token-file or --auth-token, not both")
    if token_file:
        token = read_token_file(token_file)
    return SecuritySettings(
        token=token or None,
        tls_cert=getattr(args, "tls_cert", None),
        tls_key=getattr(args, "tls_key", None),
        tls_ca=getattr(args, "tls_ca", None),
        tls_server_name=getattr(args, "tls_server_name", None),
        max_streams_per_client=int(getattr(args, "max_streams_per_client", 0) or 0),
    )


@dataclass(frozen=True)
class GrpcSettings:
    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # largest message this server sends
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # largest message it accepts (media inline)
    grace_s: float = 10.0
    security: SecuritySettings = field(default_factory=SecuritySettings)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        _positive("max_message_bytes", self.max_message_bytes)
        _positive("max_request_bytes", self.max_request_bytes)
        _positive("--grace-seconds", self.grace_s, allow_zero=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class EncoderLimits:
    """Bounds on one Encode call and its items (bad or oversized input -> INVALID_ARGUMENT)."""

    max_items_per_request: int = 64
    max_item_bytes: int = 64 << 20  # encoded media bytes per item
    max_image_pixels: int = 178_956_970  # decoded source pixels
    max_image_patches: int = 32768
    max_audio_seconds: float = 600.0
    max_video_frames: int = 64
    max_inflight_items: int = 1024  # above this, new calls get RESOURCE_EXHAUSTED

    def __post_init__(self) -> None:
        for name in (
            "max_items_per_request",
            "max_item_bytes",
            "max_image_pixels",
            "max_image_patches",
            "max_audio_seconds",
            "max_video_frames",
            "max_inflight_items",
        ):
            _positive(f"encoder limit {name}", getattr(self, name))


@dataclass(frozen=True)
class BatcherSettings:
    max_batch_tokens: int = 8192  # patches (vision) or frames (audio) per tower call
    max_wait_ms: float = 5.0  # how long the first queued item waits for company

    def __post_init__(self) -> None:
        _positive("--max-batch-tokens", self.max_batch_tokens)
        _positive("--max-wait-ms", self.max_wait_ms, allow_zero=True)


@dataclass(frozen=True)
class EncoderSettings:
    checkpoint: str
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    metrics_port: int = 0  # 0: no exporter
    redis: RedisSettings | None = None
    device: str = "cpu"
    dtype: str = "bfloat16"
    l1_cache_bytes: int = 1 << 30
    preprocess_workers: int = 4
    limits: EncoderLimits = field(default_factory=EncoderLimits)
    batcher: BatcherSettings = field(default_factory=BatcherSettings)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"--dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        _positive("--l1-cache-mb", self.l1_cache_bytes, allow_zero=True)
        _positive("--preprocess-workers", self.preprocess_workers)
        if self.log_level.upper() not in _LOG_LEVELS:
            raise ConfigError(f"--log-level={self.log_level!r} is not one of {_LOG_LEVELS}")


def add_encoder_args(parser: argparse.ArgumentParser) -> None:
    """Encoder flags beyond the common serve flags (the CLI may add them; `encoder_settings` has defaults)."""
    limits = EncoderLimits()
    parser.add_argument("--l1-cache-mb", type=float, default=1024.0, help="in-process embedding cache budget")
    parser.add_argument("--preprocess-workers", type=int, default=4, help="CPU threads for media decoding")
    parser.add_argument("--max-items-per-request", type=int, default=limits.max_items_per_request)
    parser.add_argument("--max-item-mb", type=float, default=limits.max_item_bytes / MIB)
    parser.add_argument("--max-image-patches", type=int, default=limits.max_image_patches)
    parser.add_argument("--max-audio-seconds", type=float, default=limits.max_audio_seconds)
    parser.add_argument("--max-video-frames", type=int, default=limits.max_video_frames)
    add_message_size_args(parser)


def add_message_size_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-message-mb",
        type=float,
        default=DEFAULT_MAX_MESSAGE_BYTES / MIB,
        help="largest gRPC message sent (responses are chunked below it)",
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=DEFAULT_MAX_REQUEST_BYTES / MIB,
        help="largest gRPC request accepted (media bytes travel inline)",
    )


def redis_settings(url_flag: str | None) -> RedisSettings | None:
    """--redis-url, else INKLING_REDIS_URL, else no Redis tier."""
    url = url_flag or env_redis_url()
    if not url:
        return None
    prefix = env_str("INKLING_REDIS_KEY_PREFIX", "ink:emb:") or "ink:emb:"
    return RedisSettings(url=url, key_prefix=prefix)


def _flag(args: argparse.Namespace, name: str, default: float) -> float:
    """An optional flag's value (absent when the CLI did not call `add_encoder_args`)."""
    value = getattr(args, name, None)
    return default if value is None else value


def _grpc_settings(args: argparse.Namespace) -> GrpcSettings:
    return GrpcSettings(
        host=args.host,
        port=args.port,
        grace_s=args.grace_seconds,
        max_message_bytes=int(_flag(args, "max_message_mb", DEFAULT_MAX_MESSAGE_BYTES / MIB) * MIB),
        max_request_bytes=int(_flag(args, "max_request_mb", DEFAULT_MAX_REQUEST_BYTES / MIB) * MIB),
        security=security_settings(args),
    )


def encoder_settings(args: argparse.Namespace) -> EncoderSettings:
    """Settings from the `inkling-epd encoder` flags; the flags of `add_encoder_args` are optional."""
    d = EncoderLimits()
    limits = EncoderLimits(
        max_items_per_request=int(_flag(args, "max_items_per_request", d.max_items_per_request)),
        max_item_bytes=int(_flag(args, "max_item_mb", d.max_item_bytes / MIB) * MIB),
        max_image_patches=int(_flag(args, "max_image_patches", d.max_image_patches)),
        max_audio_seconds=float(_flag(args, "max_audio_seconds", d.max_audio_seconds)),
        max_video_frames=int(_flag(args, "max_video_frames", d.max_video_frames)),
    )
    return EncoderSettings(
        checkpoint=args.checkpoint,
        grpc=_grpc_settings(args),
        metrics_port=args.metrics_port,
        redis=redis_settings(args.redis_url),
        device=args.device,
        dtype=args.dtype,
        l1_cache_bytes=int(_flag(args, "l1_cache_mb", 1024.0) * MIB),
        preprocess_workers=int(_flag(args, "preprocess_workers", 4)),
        limits=limits,
        batcher=BatcherSettings(max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms),
        log_level=(getattr(args, "log_level", None) or env_log_level()).upper(),
    )


# ---------------------------------------------------------------------------------------------------------
# Decode replica

MTP_AUTO = "auto"  # --mtp-depth auto: the drafts per step chosen by batch size from step costs measured at start
# vLLM's published cumulative acceptance of draft positions 1..8 for Inkling (GSM8K, concurrency 64, greedy).
VLLM_MTP_ACCEPTANCE = (0.757, 0.601, 0.498, 0.411, 0.354, 0.298, 0.261, 0.223)
# --mtp-draft-head: the drafter's logits through the shared bf16 lm_head, or through an FP8 copy of it (+V*H bytes)
MTP_DRAFT_HEADS = ("bf16", "fp8")
# fp8: faster at 1-2 rows, bf16 above either way (inkling_kernels/fp8_head.preferred, decisions)
DEFAULT_MTP_DRAFT_HEAD = "fp8"


def mtp_depth_arg(text: str) -> int | str:
    """`--mtp-depth`: a number of drafts per step, or `auto`."""
    if text == MTP_AUTO:
        return MTP_AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or {MTP_AUTO!r}, got {text!r}") from None


def mtp_acceptance_arg(text: str) -> tuple[float, ...]:
    """`--mtp-acceptance`: comma-separated cumulative acceptance rates of draft positions 1, 2, ..."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None


def check_mtp_depth(depth: int | str, acceptance: tuple[float, ...]) -> None:
    """`--mtp-depth` is an integer >= 0 or `auto`; the acceptance table is cumulative: in (0, 1], non-increasing."""
    if isinstance(depth, str):
        if depth != MTP_AUTO:
            raise ConfigError(f"--mtp-depth: expected an integer >= 0 or {MTP_AUTO!r}, got {depth!r}")
    else:
        _positive("--mtp-depth", depth, allow_zero=True)
    ok = acceptance and all(0 < r <= 1 for r in acceptance)
    if not ok or any(b > a for a, b in zip(acceptance, acceptance[1:], strict=False)):
        raise ConfigError(f"--mtp-acceptance: expected non-increasing rates in (0, 1], got {list(acceptance)}")


@dataclass(frozen=True)
class DecodeEngineSettings:
    """What `decode_service.engine.build.build_engine` needs besides the checkpoint (plain data: no torch here)."""

    device: str = "cpu"
    dtype: str = "bfloat16"
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    max_model_len: int | None = None  # None: the model's context (and the KV capacity)
    enable_prefix_cache: bool = True
    snapshot_interval_blocks: int = 16
    cuda_graphs: bool = True
    async_scheduling: bool = True  # pure decode steps launch before the previous step's tokens are read
    seed: int = 0  # seeds the generators of requests without their own seed
    tensor_parallel_size: int = 1  # ranks of the replica (decode_service/engine/parallel.py), one per GPU
    expert_parallel: bool = False  # routed experts partitioned over the ranks instead of split by width
    mtp_depth: int | str = 0  # MTP speculation: drafts per step (0 = off; MTP_AUTO: by batch size, measured)
    mtp_acceptance: tuple[float, ...] = VLLM_MTP_ACCEPTANCE  # --mtp-depth auto: cumulative acceptance per position
    mtp_draft_head: str = DEFAULT_MTP_DRAFT_HEAD  # one of MTP_DRAFT_HEADS: the drafter's lm_head

    def __post_init__(self) -> None:
        _positive("--tensor-parallel-size", self.tensor_parallel_size)
        if self.mtp_draft_head not in MTP_DRAFT_HEADS:
            raise ConfigError(f"--mtp-draft-head must be one of {MTP_DRAFT_HEADS}, got {self.mtp_draft_head!r}")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ConfigError("--enable-expert-parallel needs --tensor-parallel-size > 1")
        check_mtp_depth(self.mtp_depth, self.mtp_acceptance)
        if self.mtp_depth == MTP_AUTO and self.tensor_parallel_size > 1:
            raise ConfigError(
                "--mtp-depth auto: the start-up cost measurement does not run under --tensor-parallel-size > 1 yet"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"--dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        _positive("--kv-budget-mb", self.kv_cache_bytes)
        _positive("--max-num-seqs", self.max_num_seqs)
        _positive("--max-batch-tokens", self.max_num_batched_tokens)
        _positive("--page-size", self.page_size)
        _positive("--snapshot-interval-blocks", self.snapshot_interval_blocks)
        if self.max_model_len is not None:
            _positive("--max-model-len", self.max_model_len)


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds on one Generate call (bad or oversized input -> INVALID_ARGUMENT / RESOURCE_EXHAUSTED)."""

    max_prompt_tokens: int | None = None  # None: the engine's context limit
    max_media_items: int = 32
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_live_requests: int = 1024  # encoding, queued and running together; above it: RESOURCE_EXHAUSTED
    max_completion_tokens: int | None = None  # cap on sampling.max_tokens; None: the context
    default_max_tokens: int = 4096  # sampling.max_tokens unset (still capped by the context and the cap above)

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-prompt-tokens", self.max_prompt_tokens),
            ("--max-completion-tokens", self.max_completion_tokens),
        ):
            if value is not None:
                _positive(flag, value)
        _positive("--max-media-items", self.max_media_items, allow_zero=True)
        _positive("--max-logprobs", self.max_logprobs, allow_zero=True)
        _positive("--max-stop-strings", self.max_stop_strings, allow_zero=True)
        _positive("--max-stop-string-chars", self.max_stop_string_chars)
        _positive("--max-live-requests", self.max_live_requests)
        _positive("--default-max-tokens", self.default_max_tokens)


@dataclass(frozen=True)
class RedisPrefixSettings:
    """The shared Redis tier of KV prefixes (`decode_service.engine.worker.redis_tier`)."""

    key_prefix: str = "ink:kvp:v1:"
    ttl_s: int | None = 3600
    max_value_bytes: int = 64 << 20  # larger values are not stored (they stall a single-threaded server)
    write_queue: int = 256  # queued values; beyond this (or `max_pending_bytes`) new values are dropped
    max_pending_bytes: int = 256 << 20
    retry_after_s: float = 1.0  # after an error, Redis is skipped this long (a miss, not a stall)
    probe_bytes: int = 4 << 20  # value size used to measure Redis throughput at start-up

    def __post_init__(self) -> None:
        if not self.key_prefix:
            raise ConfigError("--redis-prefix-key-prefix must not be empty")
        if self.ttl_s is not None:
            _positive("--redis-prefix-ttl-s", self.ttl_s)
        _positive("--redis-prefix-max-value-mb", self.max_value_bytes)
        _positive("--redis-prefix-write-queue", self.write_queue)
        _positive("--redis-prefix-max-pending-mb", self.max_pending_bytes)
        _positive("--redis-prefix-retry-after-s", self.retry_after_s, allow_zero=True)
        _positive("--redis-prefix-probe-mb", self.probe_bytes)


@dataclass(frozen=True)
class DecodeSettings:
    checkpoint: str
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    metrics_port: int = 0  # 0: no exporter
    redis: RedisSettings | None = None
    engine: DecodeEngineSettings = field(default_factory=DecodeEngineSettings)
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    redis_prefix: RedisPrefixSettings | None = None  # None: no shared KV prefix tier
    encoders: tuple[str, ...] = ()  # encoder targets (common.targets)
    local_encode: bool = False  # load the towers and encode in-process when no encoder is reachable
    replica_id: str = ""  # name published to the router's prefix directory ("" = publish nothing)
    model_name: str = "inkling"  # the model id clients and the metrics see (never a filesystem path)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.redis_prefix is not None and self.redis is None:
            raise ConfigError("--redis-prefix needs a Redis: give --redis-url or set INKLING_REDIS_URL")
        if self.log_level.upper() not in _LOG_LEVELS:
            raise ConfigError(f"--log-level={self.log_level!r} is not one of {_LOG_LEVELS}")


def decode_settings(args: argparse.Namespace) -> DecodeSettings:
    """Settings from the `inkling-epd decode` flags (`tools/cli.py`: `_serve_common` + `_add_decode_args`)."""
    engine = DecodeEngineSettings(
        device=args.device,
        dtype=args.dtype,
        kv_cache_bytes=int(args.kv_budget_mb * MIB),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batch_tokens,
        page_size=args.page_size,
        max_model_len=args.max_model_len,
        enable_prefix_cache=args.prefix_cache,
        snapshot_interval_blocks=args.snapshot_interval_blocks,
        cuda_graphs=args.cuda_graphs,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.enable_expert_parallel,
        mtp_depth=args.mtp_depth,
        mtp_acceptance=_flag(args, "mtp_acceptance", VLLM_MTP_ACCEPTANCE),
        mtp_draft_head=_flag(args, "mtp_draft_head", DEFAULT_MTP_DRAFT_HEAD),
    )
    limits = ServiceLimits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_media_items=args.max_media_items,
        max_logprobs=args.max_logprobs,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_live_requests=args.max_live_requests,
        max_completion_tokens=args.max_completion_tokens,
        default_max_tokens=args.default_max_tokens,
    )
    redis_prefix = None
    if args.redis_prefix:
        redis_prefix = RedisPrefixSettings(
            key_prefix=args.redis_prefix_key_prefix,
            ttl_s=args.redis_prefix_ttl_s,
            max_value_bytes=int(args.redis_prefix_max_value_mb * MIB),
            write_queue=args.redis_prefix_write_queue,
            max_pending_bytes=int(args.redis_prefix_max_pending_mb * MIB),
            retry_after_s=args.redis_prefix_retry_after_s,
            probe_bytes=int(args.redis_prefix_probe_mb * MIB),
        )
    return DecodeSettings(
        checkpoint=args.checkpoint,
        model_name=served_model_name(args.checkpoint, args.model_name),
        grpc=_grpc_settings(args),
        metrics_port=args.metrics_port,
        redis=redis_settings(args.redis_url),
        engine=engine,
        limits=limits,
        redis_prefix=redis_prefix,
        encoders=parse_targets(args.encoders, "--encoders", required=False),
        local_encode=args.local_encode,
        replica_id=args.replica_id,
        log_level=(args.log_level or env_log_level()).upper(),
    )


def served_model_name(checkpoint: str, name: str | None = None) -> str:
    """The model id clients see (`ModelInfo.model_id`, the `model_name` metric label): `--model-name`, else the
    checkpoint directory's name, never the server's filesystem path."""
    if name is not None:
        if not name.strip():
            raise ConfigError("--model-name: must not be empty")
        return name.strip()
    return Path(checkpoint).resolve().name
