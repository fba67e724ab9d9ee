"""Prefix routing: the contract between the router and the decode replicas (spec: serving, prefix routing).

The router cannot reproduce the engine's block hashes (they need chat rendering, placeholder expansion and
mm_keys, i.e. the tokenizer and media decoding), so both sides use *routing* hashes computed from the
`GenerateRequest` itself by `request_prefix_hashes`: a hash chain over the chat messages (one link per
message) or over fixed blocks of prompt token ids (one link per `ROUTING_BLOCK_TOKENS`), rooted in the cache
salt, the tools and the prompt's media. Once a replica has the request's prompt in its prefix cache it calls
`PrefixDirectory.publish(replica_id, hashes)`: each hash becomes the Redis hash `prefix_directory_key(h)`
whose fields are replica ids (the `host:port` the router dials) and whose values are expiry times in unix
seconds; the key itself expires `ttl_s` after the last publish. No torch, no gRPC server code.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections.abc import Sequence

from proto.inkling_epd.v1 import generator_pb2

ROUTING_BLOCK_TOKENS = 64
MAX_ROUTING_HASHES = 128
PREFIX_DIRECTORY_PREFIX = "ink:pfx:v1:"
_ROUTING_ROOT_TAG = b"inkling-epd/routing-prefix/v1"


def prefix_directory_key(prefix_hash: bytes, namespace: str = "") -> str:
    """Redis key of one routing hash: a Redis hash {replica id: expiry unix seconds}."""
    return f"{PREFIX_DIRECTORY_PREFIX}{namespace}:{prefix_hash.hex()}"


def _link(parent: bytes, payload: bytes) -> bytes:
    return hashlib.sha256(parent + struct.pack("<Q", len(payload)) + payload).digest()


def request_prefix_hashes(request: generator_pb2.GenerateRequest, max_hashes: int = MAX_ROUTING_HASHES) -> list[bytes]:
    """Chained routing hashes of the request's leading messages (chat), full token blocks (token prompt) or
    full byte blocks (text prompt)."""
    root = _link(_ROUTING_ROOT_TAG, request.cache_salt.encode())
    kind = request.WhichOneof("prompt")
    hashes: list[bytes] = []
    if kind == "chat":
        chat = request.chat
        header = b"".join(t.SerializeToString(deterministic=True) for t in chat.tools)
        if chat.HasField("reasoning_effort"):
            header += struct.pack("<f", chat.reasoning_effort)
        parent = _link(root, b"chat" + header)
        for message in chat.messages[:max_hashes]:
            parent = _link(parent, message.SerializeToString(deterministic=True))
            hashes.append(parent)
    elif kind == "tokens":
        media = b"".join(hashlib.sha256(m.SerializeToString(deterministic=True)).digest() for m in request.tokens.media)
        parent = _link(root, b"tokens" + media)
        ids = request.tokens.token_ids
        for start in range(
            0, min(len(ids) // ROUTING_BLOCK_TOKENS, max_hashes) * ROUTING_BLOCK_TOKENS, ROUTING_BLOCK_TOKENS
        ):
            parent = _link(parent, struct.pack(f"<{ROUTING_BLOCK_TOKENS}I", *ids[start : start + ROUTING_BLOCK_TOKENS]))
            hashes.append(parent)
    elif kind == "text":  # no tokenizer here: blocks of UTF-8 bytes (~4 per token) stand in for token blocks
        data, block = request.text.text.encode(), 4 * ROUTING_BLOCK_TOKENS
        parent = _link(root, b"text")
        for start in range(0, min(len(data) // block, max_hashes) * block, block):
            parent = _link(parent, data[start : start + block])
            hashes.append(parent)
    return hashes


class PrefixDirectory:
    """Which replica holds which routing prefix, in Redis (`redis.asyncio` client)."""

    def __init__(self, client, namespace: str = "", ttl_s: float = 300.0) -> None:
        self.client = client
        self.namespace = namespace
        self.ttl_s = ttl_s

    async def publish(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        """Called by a decode replica once the request's prompt is in its prefix cache."""
        if not hashes:
            return
        expiry = int(time.time() + self.ttl_s)
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            key = prefix_directory_key(h, self.namespace)
            pipe.hset(key, replica_id, expiry)
            pipe.expire(key, math.ceil(self.ttl_s))
        await pipe.execute()

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Replica id -> number of leading hashes it holds (only replicas with at least one)."""
        if not hashes:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            pipe.hgetall(prefix_directory_key(h, self.namespace))
        rows = await pipe.execute()
        now = time.time()
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, row in enumerate(rows, start=1):
            holders = {_text(k) for k, v in row.items() if float(v) > now}
            alive = holders if alive is None else alive & holders
            if not alive:
                break
            for replica_id in alive:
                matched[replica_id] = depth
        return matched


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
