"""Shared Redis prefix tier: time to first token of a long multimodal prompt on "replica B".

    python bench/bench_prefix_tier.py [--lengths 128,512,2048] [--redis-url redis://127.0.0.1:6379/15]

Replica A (tiny random checkpoint, CPU, fp32) prefills the prompt and publishes its prefix to Redis. Replica B
then serves the same prompt three ways: cold (no shared tier), GPU hit (its own prefix cache, second run) and
Redis hit (a fresh replica with the tier; it fetches only when its measured cost model says fetching beats
recomputing). The Redis throughput and prefill rate are measured in the same run; the floor column is the
fetch time those measurements predict (round trips + bytes / throughput). The crossover is the prompt length
above which the cost model fetches, next to the one observed. Keys go under a fresh prefix that is deleted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid

import redis
import torch

from common.checkpoint import CheckpointFiles, load_decoder_weights
from common.config import ModelConfig, load_model_config
from common.settings import RedisPrefixSettings
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import MultimodalItem, Request, SamplingParams
from decode_service.engine.worker.prefix_format import part_sizes
from decode_service.engine.worker.prefix_store import PrefixStore
from decode_service.model.inkling import InklingDecoder
from tools.make_tiny_checkpoint import make_tiny_checkpoint

IMAGE_ROWS = 64
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
# Inkling (default config, bf16): global KV per token and one boundary (sliding window 511 tokens + conv), from
# serving spec section 0; printed as the fetch floor a real replica would pay at the measured throughput.
INKLING_GLOBAL_BYTES_PER_TOKEN = 11 * 2 * 8 * 128 * 2
INKLING_BOUNDARY_BYTES = 55 * 2 * 16 * 128 * 2 * 512 + int(6.1 * (1 << 20))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def settings(device: str) -> EngineSettings:
    return EngineSettings(
        kv_cache_bytes=256 << 20,
        page_size=16,
        max_num_batched_tokens=512,
        snapshot_interval_blocks=8,
        device=device,
    )


def request(config: ModelConfig, length: int, request_id: str) -> Request:
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, 199_000, (length,), generator=gen).tolist()
    tokens[8 : 8 + IMAGE_ROWS] = [config.image_token_id] * IMAGE_ROWS
    image = MultimodalItem(b"\x01" * 32, 8, torch.randn(IMAGE_ROWS, config.text.hidden_size, generator=gen))
    return Request(request_id, tokens, FIRST_TOKEN, mm_items=(image,))


def ttft(engine: Engine, req: Request) -> tuple[float, int, int]:
    """(seconds to the first token, tokens from the GPU prefix cache, tokens from Redis)."""
    start = time.perf_counter()
    engine.add_request(req)
    while True:
        for out in engine.step():
            if out.new_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished:
                    engine.step()
                return elapsed, out.num_cached_tokens_gpu, out.num_cached_tokens_redis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    lengths = [int(n) for n in args.lengths.split(",")]
    client = redis.Redis.from_url(args.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    prefix = f"bench:kvp:{uuid.uuid4().hex[:12]}:"
    store = PrefixStore(client, RedisPrefixSettings(key_prefix=prefix, ttl_s=600))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            make_tiny_checkpoint(tmp, nvfp4=True, seed=0)
            config = load_model_config(tmp)
            weights, _ = load_decoder_weights(CheckpointFiles(tmp), config, dtype=dtype, device=args.device)
            model = InklingDecoder.from_weights(config.text, weights, dtype, args.device)
        rows = []
        cost = None
        for length in lengths:
            a = Engine(model, config, settings(args.device), store)
            ttft(a, request(config, length, "a"))
            store.flush(60.0)
            b = Engine(model, config, settings(args.device))
            cold, _, _ = ttft(b, request(config, length, "b-cold"))
            gpu, gpu_tokens, _ = ttft(b, request(config, length, "b-gpu"))
            fresh = Engine(model, config, settings(args.device), store)
            tier = fresh.redis_prefix
            cost = tier.cost
            hit, _, redis_tokens = ttft(fresh, request(config, length, "b-redis"))
            floor = cost.fetch_seconds(tier.stats.bytes_fetched) if redis_tokens else 0.0
            decision = max(tier.stats.decisions, key=tier.stats.decisions.get)
            rows.append((length, gpu_tokens, redis_tokens, tier.stats.bytes_fetched, cold, gpu, hit, floor, decision))
        assert cost is not None
        print(
            f"Redis GET {cost.redis_bytes_per_s / 1e6:.0f} MB/s, round trip {cost.redis_latency_s * 1e3:.2f} ms; "
            f"prefill {cost.prefill_tokens_per_s:.0f} tokens/s (tiny checkpoint, {args.device}, {args.dtype})"
        )
        print()
        print(
            "| prompt tokens | GPU-hit tokens | Redis-hit tokens | bytes fetched | cold TTFT ms | GPU-hit TTFT ms | "
            "Redis-hit TTFT ms | fetch floor ms | decision |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for length, gpu_tokens, redis_tokens, nbytes, cold, gpu, hit, floor, decision in rows:
            print(
                f"| {length} | {gpu_tokens} | {redis_tokens} | {nbytes} | {cold * 1e3:.1f} | {gpu * 1e3:.1f} | "
                f"{hit * 1e3:.1f} | {floor * 1e3:.2f} | {decision} |"
            )
        tier_bytes = tier.global_bytes() / tier.page_size
        boundary = tier.boundary_bytes(lengths[-1] // tier.page_size * tier.page_size)
        per_token = 1 / cost.prefill_tokens_per_s - tier_bytes / cost.redis_bytes_per_s
        fixed = 2 * cost.redis_latency_s + boundary / cost.redis_bytes_per_s
        modelled = f"{fixed / per_token:.0f} tokens" if per_token > 0 else "never (fetching a token costs more)"
        observed = next((r[0] for r in rows if r[2] and r[6] < r[4]), None)
        print()
        print(f"crossover: cost model {modelled}; observed {observed or 'none'} of {lengths}")
        inkling = 4096 * INKLING_GLOBAL_BYTES_PER_TOKEN + INKLING_BOUNDARY_BYTES
        print(
            f"Inkling default geometry, 4096-token prefix: {inkling / (1 << 20):.0f} MiB to fetch = "
            f"{cost.fetch_seconds(inkling) * 1e3:.0f} ms at this Redis throughput (of which the boundary: "
            f"{INKLING_BOUNDARY_BYTES / (1 << 20):.0f} MiB in {len(part_sizes(INKLING_BOUNDARY_BYTES))} values)"
        )
    finally:
        store.close()
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)
        client.close()


if __name__ == "__main__":
    main()
