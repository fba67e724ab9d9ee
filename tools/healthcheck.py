"""`python -m tools.healthcheck HOST:PORT [--service NAME]`: exit 0 when the server reports SERVING, else 1.

A `grpc.health.v1` probe for container HEALTHCHECKs and the local launcher (no extra binary in the images).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import sync_channel
from common.settings import SecuritySettings, add_security_args, security_settings

UNREACHABLE = "UNREACHABLE"


def check(address: str, service: str = "", timeout_s: float = 2.0, security: SecuritySettings | None = None) -> str:
    """The server's health status name (`SERVING`, `NOT_SERVING`, ...), or `UNREACHABLE` on any RPC error.
    `security`: TLS settings of a server started with --tls-* flags (health needs no token)."""
    with sync_channel(address, security) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return UNREACHABLE
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of a gRPC server")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds")
    add_security_args(parser, max_streams_per_client=None)
    args = parser.parse_args(argv)
    status = check(args.address, args.service, args.timeout, security_settings(args))
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
