"""`tools/demo.py` pieces that need no cluster: the request list and the summary table."""

from __future__ import annotations

from tools.demo import Result, build_requests, demo_spec, format_table
from tools.make_sample_media import make_sample_media


def test_summary_names_replicas_and_sums_cache_hits_per_tier():
    results = [
        Result(
            "text+image",
            replica="127.0.0.1:5001",
            prompt_tokens=431,
            completion_tokens=16,
            finish="length",
            ttft_s=0.136,
            mm_encoded=1,
        ),
        Result(
            "text+image again",
            replica="127.0.0.1:5001",
            prompt_tokens=431,
            completion_tokens=16,
            finish="length",
            ttft_s=0.035,
            cached_gpu=416,
            mm_cached=1,
        ),
        Result(
            "text+image, other replica",
            replica="127.0.0.1:5002",
            prompt_tokens=431,
            completion_tokens=16,
            finish="length",
            ttft_s=0.036,
            cached_redis=400,
            mm_cached=1,
        ),
        Result("broken", error="UNAVAILABLE: gone"),
    ]
    lines = format_table(results).splitlines()
    assert lines[0].split()[:2] == ["request", "replica"]
    assert lines[3].split()[-8:] == ["127.0.0.1:5001", "431", "16", "length", "35", "416", "0", "1/0"]
    assert "UNAVAILABLE: gone" in lines[5] and lines[5].split()[1] == "-"
    assert lines[-2] == (
        "cache hits: prefix gpu 416 + redis 400 of 1293 prompt tokens; embedding cache 2 of 3 media items"
    )
    assert lines[-1] == "served by: 127.0.0.1:5001 x2, 127.0.0.1:5002 x1"


def test_the_repeats_are_the_first_request_again(tmp_path):
    make_sample_media(tmp_path)
    requests = build_requests(tmp_path, max_tokens=4)
    first, again, other = requests[0], requests[-2], requests[-1]
    assert not again.direct_to_other and other.direct_to_other
    for repeat in (again, other):
        assert repeat.request.chat == first.request.chat and repeat.request.request_id != first.request.request_id
    assert len({r.request.request_id for r in requests}) == len(requests)


def test_the_demo_runs_on_its_own_redis_by_default(tmp_path):
    import argparse

    args = argparse.Namespace(encoders=2, decoders=2, redis="private")
    spec = demo_spec(args, tmp_path / "tiny", "cpu", "float32", tmp_path)
    assert spec.redis == "private" and spec.extra_args["decode"] == ["--redis-prefix"]
