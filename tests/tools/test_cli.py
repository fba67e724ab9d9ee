"""`inkling-epd` front door: --version, bad flag values end in an argparse-style error (exit 2), not a
traceback; the served model id is never a filesystem path."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import ConfigError
from decode_service.server import served_model_name

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_version():
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("inkling-epd "), out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["router", "--log-level", "foo", "--decoders", "a:1"], "--log-level: invalid choice: 'FOO'"),
        (["router", "--port", "0", "--decoders", "nohost"], "inkling-epd router: error: --decoders: 'nohost'"),
        (["router", "--port", "0", "--decoders", ""], "inkling-epd router: error: --decoders"),
        (["up", "--checkpoint", "x", "--redis-url", "localhost"], "redis: expected auto, private, none"),
    ],
)
def test_bad_flag_values_end_in_a_clear_error(args: list[str], message: str):
    out = cli(*args)
    assert out.returncode == 2, out
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = cli("router", "--port", str(port), "--decoders", "127.0.0.1:1")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot bind gRPC server to 127.0.0.1:{port}: port in use" in out.stderr


def test_the_model_id_is_never_the_checkpoint_path(tmp_path):
    checkpoint = tmp_path / "models" / "inkling-tiny"
    assert served_model_name(str(checkpoint)) == "inkling-tiny"
    assert served_model_name(f"{checkpoint}/") == "inkling-tiny"
    assert served_model_name(str(checkpoint), "inkling") == "inkling"
    with pytest.raises(ConfigError, match="--model-name"):
        served_model_name(str(checkpoint), " ")
