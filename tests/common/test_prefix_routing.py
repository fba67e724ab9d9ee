"""Routing hashes: the contract between the router and the decode replicas."""

from __future__ import annotations

from common.prefix_routing import (
    PREFIX_DIRECTORY_PREFIX,
    ROUTING_BLOCK_TOKENS,
    prefix_directory_key,
    request_prefix_hashes,
)
from proto.inkling_epd.v1 import generator_pb2 as pb


def test_prefix_hashes_follow_shared_prefixes():
    def chat(*texts: str, salt: str = "") -> pb.GenerateRequest:
        messages = [pb.Message(role=pb.ROLE_USER, content=[pb.ContentPart(text=t)]) for t in texts]
        return pb.GenerateRequest(chat=pb.ChatPrompt(messages=messages), cache_salt=salt)

    short, longer = request_prefix_hashes(chat("sys", "q1")), request_prefix_hashes(chat("sys", "q1", "q2"))
    assert len(short) == 2 and longer[:2] == short and len(longer) == 3
    assert not set(request_prefix_hashes(chat("sys", "q1", salt="tenant"))) & set(short)

    ids = list(range(2 * ROUTING_BLOCK_TOKENS + 5))
    base = request_prefix_hashes(pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=ids)))
    ids[ROUTING_BLOCK_TOKENS + 1] += 1
    changed = request_prefix_hashes(pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=ids)))
    assert len(base) == 2 and base[0] == changed[0] and base[1] != changed[1]
    text = "x" * (8 * ROUTING_BLOCK_TOKENS + 5)
    base = request_prefix_hashes(pb.GenerateRequest(text=pb.TextPrompt(text=text)))
    tail = request_prefix_hashes(pb.GenerateRequest(text=pb.TextPrompt(text=text[:-5] + "y" * 5)))
    changed = request_prefix_hashes(pb.GenerateRequest(text=pb.TextPrompt(text=text[:-10] + "y" * 10)))
    assert len(base) == 2 and tail == base and changed[0] == base[0] and changed[1] != base[1]
    assert prefix_directory_key(base[0], "ns").startswith(PREFIX_DIRECTORY_PREFIX + "ns:")
