"""`inkling-epd` front door: `generate --local` on a make-tiny checkpoint, the decode flags, --version, bad flag
values ending in an argparse-style error (exit 2) rather than a traceback, and the served model id (never a
filesystem path)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from common.settings import DecodeEngineSettings, RedisPrefixSettings, ServiceLimits, decode_settings, served_model_name
from tools.cli import build_parser, main
from tools.make_tiny_checkpoint import make_tiny_checkpoint

PROMPT = [200000, 200004, 9906, 11, 1917, 200010]


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(out, nvfp4=False, seed=3)
    return out


def generate_json(capsys, checkpoint, *flags: str) -> dict:
    argv = ["generate", "--local", "--checkpoint", str(checkpoint), "--dtype", "float32", "--json", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@torch.no_grad()
def test_generate_local_greedy_equals_transformers_generate(tiny_bf16, capsys):
    from transformers import InklingForConditionalGeneration

    hf = InklingForConditionalGeneration.from_pretrained(tiny_bf16, dtype=torch.float32).eval()
    hf.config.text_config._attn_implementation = "eager"
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, len(PROMPT) :
    ].tolist()
    ids = ",".join(map(str, PROMPT))
    ours = generate_json(capsys, tiny_bf16, "--prompt-ids", ids, "--max-tokens", "12", "--ignore-eos")
    assert ours["token_ids"] == ref and ours["finish_reason"] == "length"
    assert ours["prompt_token_ids"] == PROMPT


@pytest.fixture(scope="module")
def tiny_nvfp4(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-nvfp4")
    make_tiny_checkpoint(out, nvfp4=True, seed=4)
    return out


@pytest.mark.parametrize(
    ("kind", "parallel"),
    [("bf16", ["--tensor-parallel-size", "2"]), ("nvfp4", ["--tensor-parallel-size", "2", "--enable-expert-parallel"])],
)
def test_generate_local_tensor_parallel_equals_one_process(request, capsys, kind, parallel):
    """Two gloo ranks (rank 0 here, rank 1 a child process) give the single-process greedy tokens; the prompt
    runs past the sliding window, so sliding pages are recycled on both ranks."""
    checkpoint = request.getfixturevalue(f"tiny_{kind}")
    ids = ",".join(map(str, PROMPT * 4))
    flags = ["--prompt-ids", ids, "--max-tokens", "10", "--ignore-eos"]
    single = generate_json(capsys, checkpoint, *flags)
    ranks = generate_json(capsys, checkpoint, *flags, *parallel)
    assert len(single["token_ids"]) == 10
    assert ranks["token_ids"] == single["token_ids"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tensor-parallel-size", "3"], "tensor_parallel_size=3 does not divide the sliding layers' query heads (4)"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["--enable-expert-parallel"], "--enable-expert-parallel needs --tensor-parallel-size > 1"),
    ],
)
def test_generate_local_bad_tensor_parallel_flags_name_the_problem(tiny_bf16, capsys, flags, message):
    argv = ["generate", "--local", "--checkpoint", str(tiny_bf16), "--prompt-ids", "1,2", *flags]
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_decode_tensor_parallel_flags_reach_the_settings():
    args = build_parser().parse_args(
        ["decode", "--checkpoint", "x", "--tensor-parallel-size", "2", "--enable-expert-parallel"]
    )
    engine = decode_settings(args).engine
    assert (engine.tensor_parallel_size, engine.expert_parallel) == (2, True)


def test_generate_local_json_and_out_of_vocab_prompts(tiny_bf16, capsys):
    result = generate_json(capsys, tiny_bf16, "--prompt-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos")
    assert result["prompt_token_ids"] == [1, 2, 3]
    assert len(result["token_ids"]) == 4 and isinstance(result["text"], str)
    assert result["finish_reason"] == "length"
    argv = ["generate", "--local", "--checkpoint", str(tiny_bf16), "--prompt-ids", "1,250000", "--max-tokens", "1"]
    assert main(argv) == 1
    assert "out of range" in capsys.readouterr().err


def test_decode_flags_build_the_settings_tree():
    args = build_parser().parse_args(["decode", "--checkpoint", "ck"])
    settings = decode_settings(args)
    assert settings.engine == DecodeEngineSettings()
    assert settings.limits == ServiceLimits() and settings.redis_prefix is None and settings.encoders == ()
    args = build_parser().parse_args(
        [
            "decode",
            "--checkpoint",
            "ck",
            "--redis-url",
            "redis://127.0.0.1:6379/15",
            "--redis-prefix",
            "--redis-prefix-ttl-s",
            "60",
            "--max-num-seqs",
            "3",
            "--kv-budget-mb",
            "2",
            "--default-max-tokens",
            "7",
            "--encoders",
            "a:1,dns:///enc:2",
            "--no-prefix-cache",
        ]
    )
    settings = decode_settings(args)
    assert settings.engine.max_num_seqs == 3 and settings.engine.kv_cache_bytes == 2 << 20
    assert not settings.engine.enable_prefix_cache and settings.limits.default_max_tokens == 7
    assert settings.redis_prefix == RedisPrefixSettings(ttl_s=60) and settings.encoders == ("a:1", "dns:///enc:2")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--kv-budget-mb", "-1"], "--kv-budget-mb"),
        (["--default-max-tokens", "0"], "--default-max-tokens"),
        (["--redis-prefix"], "--redis-prefix needs a Redis"),
        (["--encoders", "nohost"], "--encoders"),
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--mtp-depth", "auto", "--tensor-parallel-size", "2"], "--mtp-depth auto"),
    ],
)
def test_bad_decode_flags_name_the_flag(flags, message, monkeypatch):
    monkeypatch.delenv("INKLING_REDIS_URL", raising=False)
    args = build_parser().parse_args(["decode", "--checkpoint", "ck", *flags])
    with pytest.raises(ConfigError, match=message):
        decode_settings(args)


def test_mtp_depth_runs_under_tensor_parallelism():
    args = build_parser().parse_args(
        ["decode", "--checkpoint", "ck", "--mtp-depth", "2", "--tensor-parallel-size", "2"]
    )
    engine = decode_settings(args).engine
    assert (engine.mtp_depth, engine.tensor_parallel_size) == (2, 2)


def test_decode_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--help"])
    out = capsys.readouterr().out
    assert "--redis-prefix-ttl-s" in out and "(default: 3600)" in out and "(default: 64)" in out


def test_generate_json_echoes_the_rendered_chat_prompt(tiny_bf16, capsys):
    from decode_service.chat import ChatMessage, TextPart, render_chat
    from decode_service.prompt import DEFAULT_REASONING_EFFORT

    result = generate_json(capsys, tiny_bf16, "--prompt", "hello there", "--max-tokens", "2", "--ignore-eos")
    rendered = render_chat([ChatMessage("user", [TextPart("hello there")])], [], DEFAULT_REASONING_EFFORT, [])
    assert result["prompt_token_ids"] == list(rendered.token_ids)
    assert result["usage"]["prompt_tokens"] == len(rendered.token_ids)


def test_encoder_flags_build_the_encoder_settings():
    from common.settings import encoder_settings

    args = build_parser().parse_args(["encoder", "--checkpoint", "ck", "--max-message-mb", "4", "--port", "0"])
    settings = encoder_settings(args)
    assert settings.grpc.max_message_bytes == 4 << 20 and settings.grpc.port == 0 and settings.dtype == "bfloat16"


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


def test_mtp_draft_head_flag():
    """`--mtp-draft-head` reaches the engine settings (default fp8, measured); `generate --local` takes it too; other
    values are refused by the parser."""
    from common.settings import DEFAULT_MTP_DRAFT_HEAD

    engine = decode_settings(build_parser().parse_args(["decode", "--checkpoint", "ck", "--mtp-depth", "2"])).engine
    assert engine.mtp_draft_head == DEFAULT_MTP_DRAFT_HEAD == "fp8"
    args = build_parser().parse_args(["decode", "--checkpoint", "ck", "--mtp-draft-head", "bf16"])
    assert decode_settings(args).engine.mtp_draft_head == "bf16"
    generate = ["generate", "--local", "--checkpoint", "ck", "--prompt", "hi", "--mtp-draft-head", "bf16"]
    assert build_parser().parse_args(generate).mtp_draft_head == "bf16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--checkpoint", "ck", "--mtp-draft-head", "int4"])
    with pytest.raises(ConfigError, match="--mtp-draft-head"):
        DecodeEngineSettings(mtp_draft_head="int4")
