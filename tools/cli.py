"""`inkling-epd`: the one command line front door. Each subcommand imports its module lazily."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate from a chat prompt or token ids (--server ADDR: through a "
        "running router/decode replica; --local: in-process, no services)",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true", help="run encoder + decoder in this process")
    mode.add_argument("--server", metavar="ADDR", help="host:port of a router or decode replica")
    p.add_argument("--checkpoint", help="checkpoint directory (--local)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="user message text (chat prompt; media flags come before it)")
    prompt.add_argument(
        "--messages",
        metavar="FILE.json",
        help="chat as a JSON list of {role, content: str | [{type: text, text} | {type: image|audio|video, path}]}",
    )
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids (one placeholder token per media item)")
    p.add_argument("--image", action="append", default=[], metavar="PATH", help="image file (repeatable)")
    p.add_argument("--audio", action="append", default=[], metavar="PATH", help="audio file (repeatable)")
    p.add_argument("--video", action="append", default=[], metavar="PATH", help="video file (repeatable)")
    p.add_argument(
        "--no-rescale", action="store_true", help="patch images and video frames as they are (RESCALE_POLICY_NONE)"
    )
    p.add_argument("--reasoning-effort", type=float, default=None, help="thinking effort in [0, 0.99] (chat)")
    s = p.add_argument_group("sampling (unset: the server's neutral default)")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--frequency-penalty", type=float, default=None)
    s.add_argument("--logprobs", type=int, default=None, help="top-N alternatives per token")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    s.add_argument(
        "--stop-token-id", action="append", type=int, default=[], metavar="ID", help="stop token id (repeatable)"
    )
    s.add_argument("--ignore-eos", action="store_true")
    c = p.add_argument_group("structured output (the answer matches one of these; JSON is compact by default)")
    cx = c.add_mutually_exclusive_group()
    cx.add_argument("--json-schema", metavar="FILE", help="JSON Schema document the answer must satisfy")
    cx.add_argument("--json-object", action="store_true", help="the answer is any JSON object")
    cx.add_argument("--regex", metavar="RE", help="regular expression the whole answer matches")
    cx.add_argument("--grammar", metavar="FILE", help="xgrammar EBNF grammar file (root rule `root`)")
    cx.add_argument("--lark", metavar="FILE", help="Lark grammar file")
    c.add_argument("--flexible-whitespace", action="store_true", help="JSON: allow any whitespace")
    p.add_argument("--stream", action="store_true", help="print text as it arrives (reasoning dimmed or marked)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the Generate call in seconds")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (token_ids, text, finish_reason, reasoning, tool_calls, usage, timings)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _add_parallel_args(p.add_argument_group("tensor parallelism (--local)"))
    from common.settings import DEFAULT_MTP_DRAFT_HEAD, MTP_DRAFT_HEADS, mtp_depth_arg

    p.add_argument(
        "--mtp-depth",
        type=mtp_depth_arg,
        default=0,
        help="--local: MTP drafts per step (0 = off, auto = by batch size)",
    )
    p.add_argument(
        "--mtp-draft-head",
        choices=MTP_DRAFT_HEADS,
        default=DEFAULT_MTP_DRAFT_HEAD,
        help="--local: the drafter's lm_head (fp8: an FP8 copy of the shared one, +V*H bytes)",
    )
    from common.settings import add_security_args

    add_security_args(p, max_streams_per_client=None)  # token / TLS to dial --server
    p.set_defaults(func=_run_generate)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise SystemExit(f"--prompt-ids: expected comma-separated integers, got {text!r}") from exc
    if not ids:
        raise SystemExit("--prompt-ids: at least one token id is required")
    return ids


def _run_generate(args: argparse.Namespace) -> int:
    from common.errors import InvalidInputError

    has_media = bool(args.image or args.audio or args.video)
    if args.messages and has_media:
        raise SystemExit("generate: --messages carries its own media; drop --image/--audio/--video")
    if args.local and not args.checkpoint:
        raise SystemExit("generate --local: --checkpoint is required")
    try:
        request = _generate_request(args)
    except InvalidInputError as exc:
        raise SystemExit(f"generate: {exc}") from exc
    if args.json and request.WhichOneof("prompt") == "chat":
        request.return_prompt_token_ids = True  # the JSON shows the prompt as rendered by the server
    return _print_stream(args, request)


def _generate_request(args: argparse.Namespace):
    """The `GenerateRequest` the flags describe: a chat (--messages, or media parts then --prompt) or a token
    prompt (--prompt-ids)."""
    from decode_service.client import build_request, load_messages, media_item, sampling_params

    media = [
        media_item(kind, path, args.no_rescale)
        for kind, paths in (("image", args.image), ("audio", args.audio), ("video", args.video))
        for path in paths
    ]
    sampling = sampling_params(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
    )
    messages = load_messages(args.messages, args.no_rescale) if args.messages else ()
    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    request = build_request(
        sampling,
        messages=messages,
        prompt=args.prompt,
        media=media,
        prompt_ids=prompt_ids,
        reasoning_effort=args.reasoning_effort,
    )
    _set_constraint(request.constraint, args)
    return request


def _set_constraint(constraint, args: argparse.Namespace) -> None:
    """--json-schema / --json-object / --regex / --grammar / --lark -> `GenerateRequest.constraint`."""
    if args.json_schema:
        constraint.json_schema = Path(args.json_schema).read_text()
    elif args.json_object:
        constraint.json_object = True
    elif args.regex is not None:
        constraint.regex = args.regex
    elif args.grammar:
        constraint.grammar = Path(args.grammar).read_text()
    elif args.lark:
        constraint.lark = Path(args.lark).read_text()
    elif args.flexible_whitespace:
        raise SystemExit("generate: --flexible-whitespace needs --json-schema or --json-object")
    if args.flexible_whitespace:
        constraint.flexible_whitespace = True


def _responses(args: argparse.Namespace, request):
    """GenerateResponse messages from the server (--server) or an in-process decode service (--local)."""
    if args.server:
        from common.auth import sync_channel
        from common.grpc_util import channel_options
        from common.settings import security_settings
        from proto.inkling_epd.v1 import generator_pb2_grpc

        with sync_channel(args.server, security_settings(args), channel_options()) as channel:
            yield from generator_pb2_grpc.GeneratorStub(channel).Generate(request, timeout=args.timeout)
        return
    import asyncio

    from common.settings import DecodeEngineSettings, served_model_name
    from decode_service.api import FinalEvent
    from decode_service.engine.build import build_engine
    from decode_service.local_encoder import LocalEncoder
    from decode_service.server import delta_message, final_message, generate_input
    from decode_service.service import DecodeService
    from encoder_service.codebook import AudioCodebook

    async def run() -> list:
        engine = build_engine(
            args.checkpoint,
            DecodeEngineSettings(
                device=args.device,
                dtype=args.dtype,
                kv_cache_bytes=256 << 20,
                max_num_seqs=4,
                tensor_parallel_size=args.tensor_parallel_size,
                expert_parallel=args.enable_expert_parallel,
                mtp_depth=args.mtp_depth,
                mtp_draft_head=args.mtp_draft_head,
            ),
        )
        encoder = LocalEncoder.load(args.checkpoint, device=args.device, dtype=args.dtype)
        codebook = AudioCodebook.load(args.checkpoint, device=args.device)
        service = DecodeService(engine, encoder, model_id=served_model_name(args.checkpoint), audio_codebook=codebook)
        await service.start(warm_up=False)
        try:
            return [
                final_message(e) if isinstance(e, FinalEvent) else delta_message(e)
                async for e in service.generate(generate_input(request, args.timeout))
            ]
        finally:
            await service.close()
            await encoder.close()

    yield from asyncio.run(run())


def _print_stream(args: argparse.Namespace, request) -> int:
    from common.errors import InklingError
    from decode_service.client import OutputPrinter

    prompt_ids = list(request.tokens.token_ids) if request.WhichOneof("prompt") == "tokens" else None
    printer = OutputPrinter(sys.stdout, stream=args.stream, prompt_token_ids=prompt_ids)
    try:
        for response in _responses(args, request):
            printer.feed(response)
    except InklingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # grpc.RpcError (imported lazily): report the status, not a traceback
        code = getattr(exc, "code", None)
        if code is None:
            raise
        print(f"error: {code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.stream:
        sys.stdout.write("\n")
    if args.json:
        print(json.dumps(printer.summary()))
    elif not args.stream:
        print(printer.text["content"])
    return 0


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a small random checkpoint in the released layout")
    p.add_argument("out_dir")
    p.add_argument("--nvfp4", action="store_true", help="NVFP4 routed experts from the second MoE layer on")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run_make_tiny)


def _run_make_tiny(args: argparse.Namespace) -> int:
    from tools.make_tiny_checkpoint import make_tiny_checkpoint

    make_tiny_checkpoint(args.out_dir, nvfp4=args.nvfp4, seed=args.seed)
    print(f"wrote tiny checkpoint to {args.out_dir}")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarise a checkpoint (layout, quantization, tensor accounting)")
    p.add_argument("checkpoint")
    p.set_defaults(func=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from common.checkpoint import inspect_checkpoint

    print(inspect_checkpoint(args.checkpoint))
    return 0


def _serve_common(p: argparse.ArgumentParser, port: int, max_streams_per_client: int = 0) -> None:
    from common.settings import add_security_args

    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=port, help="gRPC port (0 = pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics HTTP port (0 = off)")
    p.add_argument(
        "--redis-url",
        default=None,
        help="redis:// or rediss:// URL of the shared cache (default: INKLING_REDIS_URL, else no Redis)",
    )
    p.add_argument("--grace-seconds", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_security_args(p, max_streams_per_client)


def _add_parallel_args(group, default_size: int = 1) -> None:
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=default_size,
        help="ranks of the decode replica, one per GPU (cuda: GPUs 0..N-1; cpu: gloo processes)",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="partition the routed experts over the ranks instead of splitting each expert's width",
    )


def _add_decode_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `DecodeSettings` beyond the common serve flags; defaults come from the dataclasses."""
    from common.settings import (
        DTYPE_NAMES,
        MIB,
        MTP_DRAFT_HEADS,
        DecodeEngineSettings,
        RedisPrefixSettings,
        ServiceLimits,
        add_message_size_args,
        mtp_acceptance_arg,
        mtp_depth_arg,
    )

    e, lim, rp = DecodeEngineSettings(), ServiceLimits(), RedisPrefixSettings()
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory")
    parser.add_argument("--encoders", default="", help="comma-separated host:port list or dns:///name:port")
    parser.add_argument(
        "--local-encode", action="store_true", help="load the towers and encode in-process when no encoder answers"
    )
    parser.add_argument("--replica-id", default="", help="name published to the router's prefix directory")
    parser.add_argument(
        "--model-name", default=None, help="model id clients and metrics see (default: the checkpoint directory's name)"
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default=e.device, help="torch device of the decoder")
    engine.add_argument("--dtype", default=e.dtype, choices=DTYPE_NAMES, help="weights and KV dtype")
    engine.add_argument("--kv-budget-mb", type=float, default=e.kv_cache_bytes / MIB, help="KV cache budget")
    engine.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="sequences per step")
    engine.add_argument(
        "--max-batch-tokens", type=int, default=e.max_num_batched_tokens, help="tokens per step (chunked prefill)"
    )
    engine.add_argument("--page-size", type=int, default=e.page_size, help="tokens per KV page")
    engine.add_argument(
        "--max-model-len", type=int, default=e.max_model_len, help="context limit (default: the model's)"
    )
    engine.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false", help="disable the GPU prefix cache"
    )
    engine.add_argument(
        "--snapshot-interval-blocks",
        type=int,
        default=e.snapshot_interval_blocks,
        help="conv-state snapshots for the prefix cache every N blocks",
    )
    engine.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run decode steps eagerly on CUDA (same kernels; for debugging)",
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=e.async_scheduling,
        help="plan each pure decode step while the GPU runs the previous one (engine.py `Engine.step`)",
    )
    engine.add_argument("--seed", type=int, default=e.seed, help="seeds requests that bring no seed")
    _add_parallel_args(engine, e.tensor_parallel_size)
    engine.add_argument(
        "--mtp-depth",
        type=mtp_depth_arg,
        default=e.mtp_depth,
        help="MTP speculation: drafts per step from the checkpoint (0 = off; auto = by batch size, from step costs "
        "measured at start and --mtp-acceptance)",
    )
    engine.add_argument(
        "--mtp-acceptance",
        type=mtp_acceptance_arg,
        default=e.mtp_acceptance,
        help="--mtp-depth auto: cumulative acceptance of draft positions 1, 2, ... (comma-separated; default "
        "vLLM's published rates for Inkling)",
    )
    engine.add_argument(
        "--mtp-draft-head",
        choices=MTP_DRAFT_HEADS,
        default=e.mtp_draft_head,
        help="the drafter's lm_head: the shared bf16 one, or an FP8 copy of it (+V*H bytes, half the bytes per "
        "depth); the served tokens do not depend on it",
    )
    limits = parser.add_argument_group("request limits")
    limits.add_argument(
        "--max-prompt-tokens", type=int, default=lim.max_prompt_tokens, help="longer prompts: INVALID_ARGUMENT"
    )
    limits.add_argument(
        "--max-completion-tokens", type=int, default=lim.max_completion_tokens, help="cap on sampling.max_tokens"
    )
    limits.add_argument(
        "--default-max-tokens", type=int, default=lim.default_max_tokens, help="max_tokens when a request sets none"
    )
    limits.add_argument("--max-media-items", type=int, default=lim.max_media_items, help="media items per request")
    limits.add_argument("--max-logprobs", type=int, default=lim.max_logprobs, help="largest sampling.logprobs")
    limits.add_argument("--max-stop-strings", type=int, default=lim.max_stop_strings, help="stop strings per request")
    limits.add_argument(
        "--max-stop-string-chars", type=int, default=lim.max_stop_string_chars, help="characters per stop string"
    )
    limits.add_argument(
        "--max-live-requests",
        type=int,
        default=lim.max_live_requests,
        help="requests encoding, queued or running; more get RESOURCE_EXHAUSTED",
    )
    add_message_size_args(parser)
    tier = parser.add_argument_group("shared KV prefix tier (Redis)")
    tier.add_argument(
        "--redis-prefix",
        action="store_true",
        help="share KV prefixes through Redis (needs a Redis URL; used where its measured cost model beats recompute)",
    )
    tier.add_argument("--redis-prefix-key-prefix", default=rp.key_prefix, help="key prefix of the tier")
    tier.add_argument("--redis-prefix-ttl-s", type=int, default=rp.ttl_s, help="expiry of stored prefixes")
    tier.add_argument(
        "--redis-prefix-max-value-mb", type=float, default=rp.max_value_bytes / MIB, help="larger values are skipped"
    )
    tier.add_argument("--redis-prefix-write-queue", type=int, default=rp.write_queue, help="queued writes at most")
    tier.add_argument(
        "--redis-prefix-max-pending-mb", type=float, default=rp.max_pending_bytes / MIB, help="queued bytes at most"
    )
    tier.add_argument(
        "--redis-prefix-retry-after-s", type=float, default=rp.retry_after_s, help="skip Redis this long after an error"
    )
    tier.add_argument(
        "--redis-prefix-probe-mb", type=float, default=rp.probe_bytes / MIB, help="value size of the start-up probe"
    )


def _add_servers(sub: argparse._SubParsersAction) -> None:
    from common.settings import add_encoder_args

    enc = sub.add_parser(
        "encoder", help="serve the Encoder gRPC service", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    _serve_common(enc, 50061)
    enc.add_argument("--checkpoint", required=True)
    enc.add_argument("--device", default="cpu")
    enc.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    enc.add_argument("--max-batch-tokens", type=int, default=8192, help="patches/frames per tower batch")
    enc.add_argument("--max-wait-ms", type=float, default=5.0, help="batcher wait for more work")
    add_encoder_args(enc)
    enc.set_defaults(func=_lazy("encoder_service.server", "serve"))

    dec = sub.add_parser(
        "decode",
        help="serve the Generator gRPC service on one decode replica",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _serve_common(dec, 50051)
    _add_decode_args(dec)
    dec.set_defaults(func=_lazy("decode_service.server", "serve"))

    router = sub.add_parser("router", help="serve the Generator gRPC service in front of decode replicas")
    _serve_common(router, 50050, max_streams_per_client=128)
    router.add_argument("--decoders", required=True, help="comma-separated host:port list or dns:///name:port")
    router.add_argument("--model-name", default="inkling", help="the model id the replicas serve (metrics label)")
    router.set_defaults(func=_lazy("decode_service.router", "serve"))

    api = sub.add_parser("api", help="serve the OpenAI-compatible HTTP API in front of a router or decode replica")
    from decode_service.http_api.config import add_api_args

    add_api_args(api)
    api.set_defaults(func=_lazy("decode_service.http_api.server", "serve"))

    from deploy.launch import add_up_args

    up = sub.add_parser("up", help="run the docker-compose topology as local processes (restarting dead ones)")
    add_up_args(up)
    up.set_defaults(func=_lazy("deploy.launch", "main"))


def _lazy(module: str, function: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), function)(args) or 0

    return run


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"inkling-epd {version('inkling-epd')}"
    except PackageNotFoundError:
        return "inkling-epd (not installed: running from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inkling-epd", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_make_tiny(sub)
    _add_inspect(sub)
    _add_servers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from common.errors import ConfigError, InvalidInputError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, InvalidInputError) as exc:  # a bad flag value found past argparse: no traceback
        parser.exit(2, f"inkling-epd {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
