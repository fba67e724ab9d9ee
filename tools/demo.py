"""`python -m tools.demo --workdir artifacts` (`make demo`): the whole cluster on the tiny checkpoint.

1. Builds the tiny NVFP4 checkpoint and the sample media in the work directory (reused when present).
2. Starts its own empty Redis (a private `redis-server` on a free port, so the first run is cold whatever
   else listens on 127.0.0.1:6379; `--redis URL` to use another), 2 encoders, 2 decode replicas and the router as
   local processes (`deploy.launch.Cluster`; on the GPU when torch sees one), or talks to a running cluster
   with `--router HOST:PORT`.
3. Sends multimodal Generate requests through the router, printing the streamed text as it arrives: chat with
   an image, with audio, with a video, a raw token prompt, then the image request again (the router sends it
   to the replica that holds its prefix), and, when the demo started the cluster, the image request once more
   straight to the other decode replica (no GPU prefix there: the shared Redis tiers serve it).
4. Prints a summary table (which replica served each request, TTFT, prefix-cache tokens from the replica's
   GPU cache and from Redis, media items from the embedding cache vs. encoded) and shuts the cluster down.

The tiny checkpoint has random weights, so the text is noise; what matters is that it streams, that every
request ends with a Final, and that the repeated requests report cached tokens and cached media items.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc

from decode_service.router import REPLICA_METADATA_KEY
from deploy.launch import Cluster, ClusterError, ClusterSpec
from proto.inkling_epd.v1 import generator_pb2 as pb
from proto.inkling_epd.v1 import generator_pb2_grpc, media_pb2
from tools.make_sample_media import IMAGE_NAME, SAMPLE_FILES, VIDEO_NAME, WAV_16K_NAME, make_sample_media

# Arbitrary in-vocabulary ids: a raw token prompt needs no tokenizer on the client.
RAW_PROMPT_IDS = tuple(range(1000, 1000 + 40))


@dataclass(frozen=True)
class DemoRequest:
    name: str
    request: pb.GenerateRequest
    direct_to_other: bool = False  # sent to a decode replica that did not serve the first request


@dataclass
class Result:
    name: str
    replica: str = ""  # the decode replica that served it (router metadata, or the address dialled directly)
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: str = ""
    ttft_s: float = float("nan")  # client-side: send -> first delta
    cached_gpu: int = 0  # prompt tokens from the replica's own prefix cache
    cached_redis: int = 0  # prompt tokens from the shared Redis prefix tier
    mm_cached: int = 0
    mm_encoded: int = 0
    error: str = ""


def prepare_workdir(workdir: Path) -> tuple[Path, Path]:
    """The tiny checkpoint and the sample media under `workdir`, built only when missing."""
    checkpoint, media = workdir / "tiny", workdir / "media"
    if not (checkpoint / "config.json").exists():
        from tools.make_tiny_checkpoint import make_tiny_checkpoint  # needs torch: only when building

        print(f"building the tiny checkpoint in {checkpoint} ...", flush=True)
        make_tiny_checkpoint(checkpoint, nvfp4=True, seed=0)
    if not all((media / name).exists() for name in SAMPLE_FILES):
        make_sample_media(media)
    return checkpoint, media


def _chat(request_id: str, parts: list[pb.ContentPart], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        chat=pb.ChatPrompt(
            messages=[
                pb.Message(role=pb.ROLE_SYSTEM, content=[pb.ContentPart(text="You are a concise assistant.")]),
                pb.Message(role=pb.ROLE_USER, content=parts),
            ],
            reasoning_effort=0.0,
        ),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )


def build_requests(media_dir: Path, max_tokens: int = 16) -> list[DemoRequest]:
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=(media_dir / IMAGE_NAME).read_bytes())
    audio = media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=(media_dir / WAV_16K_NAME).read_bytes())
    video = media_pb2.MediaItem(
        modality=media_pb2.MODALITY_VIDEO,
        data=(media_dir / VIDEO_NAME).read_bytes(),
        video=media_pb2.VideoParams(fps=4.0, max_frames=4),
    )

    def image_chat(request_id: str) -> pb.GenerateRequest:
        return _chat(
            request_id,
            [pb.ContentPart(text="What shapes are in this picture?"), pb.ContentPart(media=image)],
            max_tokens,
        )

    return [
        DemoRequest("text+image", image_chat("demo-image")),
        DemoRequest(
            "text+audio",
            _chat(
                "demo-audio", [pb.ContentPart(media=audio), pb.ContentPart(text="Which tones do you hear?")], max_tokens
            ),
        ),
        DemoRequest(
            "text+video",
            _chat(
                "demo-video", [pb.ContentPart(text="What moves in this clip?"), pb.ContentPart(media=video)], max_tokens
            ),
        ),
        DemoRequest(
            "token ids",
            pb.GenerateRequest(
                request_id="demo-tokens",
                tokens=pb.TokenPrompt(token_ids=list(RAW_PROMPT_IDS)),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
            ),
        ),
        DemoRequest("text+image again", image_chat("demo-image-repeat")),
        DemoRequest("text+image, other replica", image_chat("demo-image-other"), direct_to_other=True),
    ]


def run_request(stub: generator_pb2_grpc.GeneratorStub, demo: DemoRequest, out: TextIO, timeout_s: float) -> Result:
    """Stream one request, writing text deltas to `out` as they arrive."""
    result = Result(demo.name)
    out.write(f"\n[{demo.name}] ")
    out.flush()
    start = time.monotonic()
    channel = pb.CHANNEL_CONTENT
    try:
        call = stub.Generate(demo.request, timeout=timeout_s)
        for response in call:
            if not result.replica:
                result.replica = dict(call.initial_metadata()).get(REPLICA_METADATA_KEY, "")
            if response.HasField("delta"):
                delta = response.delta
                if result.ttft_s != result.ttft_s:  # NaN: first delta
                    result.ttft_s = time.monotonic() - start
                if delta.channel != channel and delta.channel != pb.CHANNEL_UNSPECIFIED:
                    channel = delta.channel
                    out.write(f"<{pb.Channel.Name(channel).removeprefix('CHANNEL_').lower()}> ")
                text = delta.text or (delta.tool_call.name and f"<tool {delta.tool_call.name}>") or ""
                result.text += text
                out.write(text)
                out.flush()
            else:
                final, usage = response.final, response.final.usage
                result.finish = pb.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
                result.prompt_tokens, result.completion_tokens = usage.prompt_tokens, usage.completion_tokens
                result.cached_gpu, result.cached_redis = usage.cached_tokens_gpu, usage.cached_tokens_redis
                result.mm_cached, result.mm_encoded = usage.mm_items_cached, usage.mm_items_encoded
    except grpc.RpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
        out.write(f"<error {result.error}>")
    out.write("\n")
    out.flush()
    return result


def format_table(results: Sequence[Result]) -> str:
    """One row per request, then the cache hits per tier summed over all requests."""
    header = (
        "request",
        "replica",
        "prompt",
        "out",
        "finish",
        "TTFT ms",
        "prefix gpu",
        "prefix redis",
        "emb cached/encoded",
    )
    rows = [header]
    for r in results:
        ttft = "-" if r.ttft_s != r.ttft_s else f"{1000 * r.ttft_s:.0f}"
        rows.append(
            (
                r.name,
                r.replica or "-",
                str(r.prompt_tokens),
                str(r.completion_tokens),
                r.finish or r.error or "-",
                ttft,
                str(r.cached_gpu),
                str(r.cached_redis),
                f"{r.mm_cached}/{r.mm_encoded}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    prompt = sum(r.prompt_tokens for r in results)
    items = sum(r.mm_cached + r.mm_encoded for r in results)
    lines.append(
        f"cache hits: prefix gpu {sum(r.cached_gpu for r in results)} + redis "
        f"{sum(r.cached_redis for r in results)} of {prompt} prompt tokens; embedding cache "
        f"{sum(r.mm_cached for r in results)} of {items} media items"
    )
    replicas = sorted({r.replica for r in results if r.replica})
    lines.append("served by: " + ", ".join(f"{a} x{sum(r.replica == a for r in results)}" for a in replicas))
    return "\n".join(lines)


def run_direct(decoder: str, demo: DemoRequest, out: TextIO, timeout_s: float) -> Result:
    """Send one request straight to a decode replica (bypassing the router)."""
    with grpc.insecure_channel(decoder) as channel:
        result = run_request(generator_pb2_grpc.GeneratorStub(channel), demo, out, timeout_s)
    result.replica = result.replica or decoder
    return result


def run_demo(
    router_address: str,
    requests: Sequence[DemoRequest],
    out: TextIO,
    decoders: Sequence[str] = (),
    timeout_s: float = 300.0,
) -> list[Result]:
    """Requests through the router; `direct_to_other` ones go to a replica other than the first one's (skipped
    when the decode replicas are unknown or there is only one)."""
    results: list[Result] = []
    with grpc.insecure_channel(router_address) as channel:
        stub = generator_pb2_grpc.GeneratorStub(channel)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30)
        out.write(
            f"model {info.model_id or '(unnamed)'}: vocab {info.vocab_size}, context {info.max_context_tokens} tokens\n"
        )
        for demo in requests:
            if not demo.direct_to_other:
                results.append(run_request(stub, demo, out, timeout_s))
                continue
            others = [d for d in decoders if results and d != results[0].replica]
            if others:
                results.append(run_direct(others[0], demo, out, timeout_s))
    out.write("\n" + format_table(results) + "\n")
    return results


def default_device() -> str:
    """ "cuda" when torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def demo_spec(args: argparse.Namespace, checkpoint: Path, device: str, dtype: str, workdir: Path) -> ClusterSpec:
    """The demo's `ClusterSpec`: by default its own empty Redis, so nothing another run or process cached
    makes the first requests look warm."""
    return ClusterSpec(
        checkpoint=str(checkpoint),
        encoders=args.encoders,
        decoders=args.decoders,
        device=device,
        dtype=dtype,
        redis=args.redis,
        log_dir=str(workdir / "logs"),
        extra_args={"decode": ["--redis-prefix"]},
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="artifacts", help="where the checkpoint, media and logs live")
    parser.add_argument("--router", default=None, help="use a running cluster's router instead of starting one")
    parser.add_argument("--encoders", type=int, default=2)
    parser.add_argument("--decoders", type=int, default=2)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--redis",
        default="private",
        help="'private' (an empty redis-server of the demo's own), 'none', or a redis:// URL (default: private)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")

    workdir = Path(args.workdir)
    checkpoint, media = prepare_workdir(workdir)
    requests = build_requests(media, args.max_tokens)
    if args.router:
        results = run_demo(args.router, requests, sys.stdout)
    else:
        device = args.device or default_device()
        dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        try:
            spec = demo_spec(args, checkpoint, device, dtype, workdir)
        except ClusterError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 2
        print(
            f"starting {args.encoders} encoders, {args.decoders} decode replica(s) and the router on {device} "
            f"({dtype}; logs in {spec.log_dir}) ...",
            flush=True,
        )
        try:
            with Cluster(spec) as cluster:
                print(
                    f"router at {cluster.router_address}, decode replicas {', '.join(cluster.decoder_addresses)}\n"
                    f"redis {cluster.redis_url or '(none: no shared cache)'} ({cluster.redis_origin})",
                    flush=True,
                )
                results = run_demo(cluster.router_address, requests, sys.stdout, cluster.decoder_addresses)
                print("stopping the cluster ...", flush=True)
        except ClusterError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 1
    failed = [r.name for r in results if r.error or not r.finish]
    if failed:
        print(f"demo: requests without a Final: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
