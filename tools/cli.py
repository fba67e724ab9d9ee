"""`inkling-epd`: the one command line front door. Each subcommand imports its module lazily."""

from __future__ import annotations

import argparse
import json
import sys


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from prompt token ids (--local: in-process, no services)")
    p.add_argument("--local", action="store_true", help="run encoder + decoder in this process")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--prompt-ids", required=True, help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    if not args.local:
        raise SystemExit("generate: only --local is available in this build")
    from decode_service.local import LocalGenerator

    generator = LocalGenerator.load(args.checkpoint, device=args.device, dtype=args.dtype)
    result = generator.generate(_parse_ids(args.prompt_ids), max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
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


def _serve_common(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=port, help="gRPC port (0 = pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics HTTP port (0 = off)")
    p.add_argument("--redis-url", default=None, help="redis:// or rediss:// URL of the shared cache (default: "
                   "INKLING_REDIS_URL, else no Redis)")
    p.add_argument("--grace-seconds", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO")


def _add_servers(sub: argparse._SubParsersAction) -> None:
    from common.settings import add_encoder_args

    enc = sub.add_parser("encoder", help="serve the Encoder gRPC service")
    _serve_common(enc, 50061)
    enc.add_argument("--checkpoint", required=True)
    enc.add_argument("--device", default="cpu")
    enc.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    enc.add_argument("--max-batch-tokens", type=int, default=8192, help="patches/frames per tower batch")
    enc.add_argument("--max-wait-ms", type=float, default=5.0, help="batcher wait for more work")
    add_encoder_args(enc)
    enc.set_defaults(func=_lazy("encoder_service.server", "serve"))

    dec = sub.add_parser("decode", help="serve the Generator gRPC service on one decode replica")
    _serve_common(dec, 50051)
    dec.add_argument("--checkpoint", required=True)
    dec.add_argument("--encoders", default="", help="comma-separated host:port list or dns:///name:port")
    dec.add_argument("--local-encode", action="store_true", help="encode in-process when no encoder is reachable")
    dec.add_argument("--device", default="cpu")
    dec.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    dec.add_argument("--max-num-seqs", type=int, default=64)
    dec.add_argument("--max-batch-tokens", type=int, default=2048)
    dec.add_argument("--kv-budget-mb", type=float, default=512.0)
    dec.add_argument("--replica-id", default="", help="name published to the router's prefix directory")
    dec.set_defaults(func=_lazy("decode_service.server", "serve"))

    router = sub.add_parser("router", help="serve the Generator gRPC service in front of decode replicas")
    _serve_common(router, 50050)
    router.add_argument("--decoders", required=True, help="comma-separated host:port list or dns:///name:port")
    router.set_defaults(func=_lazy("decode_service.router", "serve"))

    up = sub.add_parser("up", help="run the docker-compose topology as local processes")
    up.add_argument("--checkpoint", required=True)
    up.add_argument("--encoders", type=int, default=1)
    up.add_argument("--decoders", type=int, default=1)
    up.add_argument("--base-port", type=int, default=50050)
    up.add_argument("--redis-url", default=None)
    up.add_argument("--device", default="cpu")
    up.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    up.set_defaults(func=_lazy("deploy.launch", "main"))


def _lazy(module: str, function: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), function)(args) or 0

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inkling-epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_make_tiny(sub)
    _add_inspect(sub)
    _add_servers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
