"""Target lists, DNS resolution and rendezvous order shared by the router and the encoder client."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import ConfigError
from common.targets import parse_targets, rendezvous_order, resolve_targets


def test_targets_are_validated_and_dns_names_resolved():
    assert parse_targets("a:1, dns:///decode:50051", "--decoders") == ("a:1", "dns:///decode:50051")
    for bad in ("", "nohost", "dns:///x", "h:0", "h:port"):
        with pytest.raises(ConfigError, match="--decoders"):
            parse_targets(bad, "--decoders")
    resolved = asyncio.run(resolve_targets(["10.0.0.1:5", "dns:///localhost:7", "dns:///no-such-host.invalid:1"]))
    assert resolved[0] == "10.0.0.1:5" and "127.0.0.1:7" in resolved and len(resolved) <= 3


def test_encoder_and_decoder_flags_share_one_rule():
    with pytest.raises(ConfigError, match="--encoders: 'no-port'"):
        parse_targets("no-port", "--encoders")
    assert parse_targets("", "--encoders", required=False) == ()
    assert parse_targets("[::1]:5", "--encoders") == ("[::1]:5",)


def test_rendezvous_order_is_a_stable_permutation():
    addresses = [f"10.0.0.{i}:1" for i in range(5)]
    order = rendezvous_order(b"k" * 32, addresses)
    assert sorted(order) == sorted(addresses) and order == rendezvous_order(b"k" * 32, list(reversed(addresses)))
    # Removing a replica keeps the relative order of the others (only its keys move).
    assert rendezvous_order(b"k" * 32, [a for a in addresses if a != order[0]]) == order[1:]
