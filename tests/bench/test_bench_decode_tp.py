"""`bench_decode --tensor-parallel-size N` at make-tiny shapes over gloo: the rank setup, random shards, floors and
the measured all-reduce run end to end on the CPU (the GPU run needs N GPUs)."""

from __future__ import annotations

import json

import pytest

from bench.bench_decode_tp import BenchArgs, launch, model_config, nvfp4_layers


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tiny_tensor_parallel_bench_runs_on_gloo(tmp_path, expert_parallel):
    out = tmp_path / "rows.json"
    args = BenchArgs(
        tiny=True, device="cpu", tensor_parallel_size=2, expert_parallel=expert_parallel,
        batches=(1, 3), contexts=(40,), reps=3,
    )  # fmt: skip
    launch(args, str(out))
    rows = json.loads(out.read_text())
    assert [(r["ctx"], r["batch"]) for r in rows] == [(40, 1), (40, 3)]
    config = model_config("small", tiny=True)
    moe_layers = sum(not d for d in config.text.dense_layers)
    for r in rows:
        touched = [int(n) for n in r["experts"].split("/")]
        assert len(touched) == moe_layers
        cap = r["batch"] * config.text.num_experts_per_tok
        assert all(0 <= n <= cap for n in touched) and (expert_parallel or all(n >= 1 for n in touched))
        assert r["all_reduce_us"] > 0 and r["bytes_ms"] > 0
        layers = config.text.num_layers
        assert r["floor_ms"] == pytest.approx(r["bytes_ms"] + 2 * layers * r["all_reduce_us"] / 1e3)
        assert r["ratio"] == pytest.approx(r["eager_ms"] / r["floor_ms"])
        assert r["graphs_ms"] is None and r["tokens_equal"] is None  # no CUDA graphs on the CPU
    assert rows[1]["gb_per_gpu"] > rows[0]["gb_per_gpu"]  # more sequences, more KV and experts per step


def test_full_depth_shapes_are_the_released_profiles():
    small, inkling = model_config("small", tiny=False).text, model_config("inkling", tiny=False).text
    assert (small.num_layers, small.hidden_size) == (42, 4096)
    assert (inkling.num_layers, inkling.hidden_size, inkling.num_heads) == (66, 6144, 64)
    assert (inkling.swa_num_kv_heads, inkling.num_kv_heads) == (16, 8)
    assert [i for i in range(42) if not small.sliding_layers[i]] == list(range(5, 42, 6))
    layers = nvfp4_layers(model_config("small", tiny=False))
    assert 2 not in layers and layers == frozenset(range(3, 42))  # layer 2's experts bf16, the rest NVFP4
