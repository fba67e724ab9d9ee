"""`bench.bench_decode`'s report pieces on CPU at make-tiny shapes: the prefill rates per chunk size and the PNG
drawn from them, transformers' Inkling timed over a (B, ctx) grid, the table's speedup column, and the Small-L8
proxy's layer mix."""

from __future__ import annotations

import pytest
from PIL import Image

from bench import hf_decode
from bench.bench_decode import Row, prefill_rate, print_goals, print_table
from bench.bench_decode_tp import TINY, model_config, nvfp4_layers
from bench.decode_plot import write_plot
from bench.floors import Ceilings
from bench.hf_decode import HFResult
from bench.proxy import layer_mix, proxy_config, proxy_nvfp4_layers, random_proxy, step_bytes, step_roofline_us
from tools.make_tiny_checkpoint import raw_config


def test_prefill_rates_per_chunk_make_the_plot(tmp_path):
    config = model_config("small", tiny=True)
    model = random_proxy(config.text, nvfp4_layers(config), device="cpu")
    rates = [(chunk, prefill_rate(model, 32, chunk)) for chunk in (16, 32)]
    assert all(rate > 0 for _, rate in rates)
    path = tmp_path / "decode.png"
    write_plot(path, {40: [(1, 3.0), (3, 2.1)], 80: [(1, 3.5), (3, 2.4)]}, rates, 32, "tiny on cpu")
    with Image.open(path) as png:
        assert png.format == "PNG" and png.size == (1210, 462)  # 11 x 4.2 inches at 110 dpi


def test_transformers_is_timed_at_every_batch_and_context():
    results = hf_decode.time_grid(raw_config(**TINY)["text_config"], [1, 3], [20], device="cpu", reps=1)
    assert sorted(results) == [(20, 1), (20, 3)]
    for r in results.values():
        assert sorted(r.times) == sorted(hf_decode.EXPERTS) and not r.skipped
        assert all(ms > 0 for ms in r.times.values()) and r.ms == min(r.times.values())
        assert r.cell() == f"{r.ms:.2f} ({r.best[0]})"


def test_table_prints_speedup_and_why_transformers_has_no_figure(capsys):
    rows = [Row(1024, b, "6/6", 0.5, "1.00", 0.9, 0.8, 120, 2, 0.7, 0.64, 0.6) for b in (1, 256)]
    full = "skipped: needs ~300 GiB, 100 GiB free"
    hf = {
        (1024, 1): HFResult({"grouped_mm": 16.0, "batched_mm": 12.0}),
        (1024, 256): HFResult(skipped={"grouped_mm": full, "eager": full}),
    }
    print_table(rows, hf, 6, Ceilings(copy_gbs=4000.0, bf16_tflops=800.0, device="test"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].endswith(
        "| 0.64 | 1.00 | 0.90 | 0.80 | 1.60x | 1.25x | 0.60 (1.20x) | 120 + 2 (20) | 0.70 | 12.00 (batched_mm) "
        "| 15.0x |"
    )
    assert lines[-1].endswith("| skipped: needs ~300 GiB, 100 GiB free | - |")
    print_goals(rows, hf)
    assert capsys.readouterr().out == "# goal ctx=1024 B=1: speedup 15.0x vs >= 15x: met\n"


def test_small_l8_keeps_inkling_small_layer_rule():
    config = proxy_config(8)
    assert layer_mix(config, proxy_nvfp4_layers(8)) == (
        "dense 0-1, bf16 experts 2, NVFP4 experts 3-7, global 5 (the rest sliding)"
    )
    with pytest.raises(ValueError, match="proxy layers 2"):
        proxy_config(2)


def test_roofline_is_the_byte_floor_until_the_gemms_turn_compute_bound():
    """At one row every op is bandwidth-bound (roofline == bytes); at a peak so low that FLOPs dominate, the
    roofline is the step's GEMM FLOPs over it plus the bytes-only rest."""
    config = model_config("small", tiny=True)
    model = random_proxy(config.text, nvfp4_layers(config), device="cpu")
    touched = {i: 2 for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "experts")}
    fast = Ceilings(copy_gbs=4000.0, bf16_tflops=1e9, device="test")  # FLOPs never bound
    assert step_roofline_us(model, 1, 40, touched, fast) == pytest.approx(
        fast.floor_us(step_bytes(model, 1, 40, touched))
    )
    slow = Ceilings(copy_gbs=4000.0, bf16_tflops=1e-6, device="test")  # FLOPs always bound
    text = config.text
    h, i, b = text.hidden_size, text.moe_intermediate_size, 8
    flops = sum(2 * b * t.numel() for n, t in model.named_parameters() if t.dim() >= 2 and "sconv" not in n
                and "rel_logits" not in n and ".mlp.experts." not in n and n != "embed.weight"
                and n != "unembed.weight")  # fmt: skip
    flops += 2 * b * text.unpadded_vocab_size * h
    flops += len(touched) * 2 * b * text.num_experts_per_tok * 3 * h * i
    for layer in range(text.num_layers):
        geo = text.layer_geometry(layer)
        visible = min(41, geo.window) if geo.window else 41
        flops += 4 * b * geo.num_heads * visible * geo.head_dim
    assert step_roofline_us(model, b, 40, touched, slow) == pytest.approx(flops / 1e-6 / 1e6, rel=1e-6)
