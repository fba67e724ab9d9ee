"""`inkling-epd generate` (decode_service/client.py + tools/cli.py) against a live in-process decode server:
a `--messages` file with media, sampling flags, `--stream` channel marking and `--json`; and `--local` with the
same flags giving the same greedy tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from common.errors import InvalidInputError
from common.settings import DecodeEngineSettings, GrpcSettings
from decode_service.chat import IMAGE_PLACEHOLDER
from decode_service.client import OutputPrinter, load_messages
from decode_service.engine.build import build_engine
from decode_service.local_encoder import LocalEncoder
from decode_service.server import build_server
from decode_service.service import DecodeService
from encoder_service.codebook import AudioCodebook
from proto.inkling_epd.v1 import generator_pb2 as pb
from tools.cli import _generate_request, build_parser, main
from tools.make_sample_media import sample_media

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def server(checkpoint):
    """host:port of a decode server that encodes media in-process."""
    encoder = LocalEncoder.load(checkpoint, dtype="float32")
    engine = build_engine(
        checkpoint,
        DecodeEngineSettings(
            dtype="float32",
            kv_cache_bytes=8 << 20,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            enable_prefix_cache=False,
        ),
    )
    decode = build_server(
        DecodeService(engine, encoder, audio_codebook=AudioCodebook.load(checkpoint)), GrpcSettings(port=0)
    )
    await decode.start()
    try:
        yield f"127.0.0.1:{decode.port}"
    finally:
        await decode.stop(0.5)
        await encoder.close()


@pytest.fixture
def messages_file(tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "shapes.png").write_bytes(sample_media()["shapes.png"])
    path = tmp_path / "chat.json"
    path.write_text(
        json.dumps(
            [
                {"role": "system", "content": "You are terse."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "path": "media/shapes.png"},
                        {"type": "text", "text": "What is in the picture?"},
                    ],
                },
            ]
        )
    )
    return path


async def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_messages_file_through_the_server(server, messages_file, capsys):
    code, out, _ = await run_cli(
        capsys,
        "--server",
        server,
        "--messages",
        str(messages_file),
        "--no-rescale",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == 4 and result["finish_reason"] == "length"
    # The chat as the server rendered it, media placeholders expanded (issue 20 item 12).
    assert len(result["prompt_token_ids"]) == result["usage"]["prompt_tokens"]
    assert result["prompt_token_ids"].count(IMAGE_PLACEHOLDER) == result["usage"]["image_tokens"]
    assert result["usage"]["image_tokens"] == 104 and result["usage"]["completion_tokens"] == 4
    assert set(result["timings"]) >= {"ttft_s", "decode_s"}


async def test_sampling_flags_reach_the_server(server, messages_file, capsys):
    flags = [
        "--server",
        server,
        "--messages",
        str(messages_file),
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--json",
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--min-p",
        "0.01",
        "--seed",
        "1234",
        "--repetition-penalty",
        "1.1",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "0.2",
        "--stop",
        "zzqx",
        "--stop-token-id",
        "200006",
    ]
    request = _generate_request(build_parser().parse_args(["generate", *flags]))
    s = request.sampling
    assert (s.temperature, s.top_k, s.seed, s.max_tokens) == (pytest.approx(0.9), 50, 1234, 5)
    assert (s.top_p, s.min_p) == (pytest.approx(0.95), pytest.approx(0.01))
    assert list(s.stop) == ["zzqx"] and list(s.stop_token_ids) == [200006] and s.ignore_eos
    assert not request.sampling.HasField("logprobs")
    first = json.loads((await run_cli(capsys, *flags))[1])
    second = json.loads((await run_cli(capsys, *flags))[1])
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 5  # seeded sampling
    code, _, err = await run_cli(capsys, *flags[:-8], "--top-p", "1.5")  # the server validates what it got
    assert code == 1 and "INVALID_ARGUMENT" in err and "sampling.top_p" in err
    code, _, err = await run_cli(capsys, *flags[:4], "--temperature", "-1")
    assert code == 1 and "sampling.temperature" in err


async def test_stream_marks_reasoning_and_answer(server, capsys):
    code, out, _ = await run_cli(
        capsys, "--server", server, "--prompt", "Hi.", "--max-tokens", "12", "--ignore-eos", "--stream", "--json"
    )
    assert code == 0
    streamed, summary = out.rsplit("\n", 2)[0], json.loads(out.rsplit("\n", 2)[1])
    for channel, marker in (("reasoning", "[reasoning] "), ("text", "[answer] ")):
        if summary[channel]:
            assert marker + summary[channel][:4] in streamed
    assert summary["reasoning"] or summary["text"]
    unmarked = streamed.replace("[reasoning] ", "").replace("[answer] ", "").replace("\n", "")
    assert unmarked == (summary["reasoning"] + summary["text"]).replace("\n", "")


def test_printer_marks_channels_in_order():
    import io

    out = io.StringIO()
    printer = OutputPrinter(out, stream=True)
    for channel, text in (
        (pb.CHANNEL_REASONING, "think"),
        (pb.CHANNEL_REASONING, "ing"),
        (pb.CHANNEL_CONTENT, "Hello"),
        (pb.CHANNEL_UNSPECIFIED, ""),
    ):
        printer.feed(pb.GenerateResponse(delta=pb.Delta(token_ids=[1], text=text, channel=channel)))
    printer.feed(pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage())))
    assert out.getvalue() == "[reasoning] thinking\n[answer] Hello"
    summary = printer.summary()
    assert summary["reasoning"] == "thinking" and summary["text"] == "Hello" and summary["finish_reason"] == "stop"
    assert summary["usage"]["completion_tokens"] == 0  # present even when zero


def test_bad_messages_files_name_the_problem(tmp_path):
    path = tmp_path / "m.json"
    for content, problem in (
        ([{"role": "robot", "content": "x"}], "message 0"),
        ([{"role": "user", "content": [{"type": "image"}]}], "part 0"),
        ([{"role": "user", "content": [{"type": "audio", "path": "missing.wav"}]}], "missing.wav"),
        ([], "non-empty"),
    ):
        path.write_text(json.dumps(content))
        with pytest.raises(InvalidInputError, match=problem):
            load_messages(path)


async def test_local_accepts_the_same_flags(server, checkpoint, messages_file, capsys):
    flags = ["--messages", str(messages_file), "--no-rescale", "--max-tokens", "4", "--ignore-eos", "--json"]
    remote = json.loads((await run_cli(capsys, "--server", server, *flags))[1])
    code, out, _ = await run_cli(capsys, "--local", "--checkpoint", str(checkpoint), *flags)
    assert code == 0
    local = json.loads(out)
    assert local["token_ids"] == remote["token_ids"]
    assert local["usage"]["image_tokens"] == 104
