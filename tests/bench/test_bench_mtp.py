"""`bench.bench_mtp` on CPU at make-tiny shapes: every (B, D) figure is measured and consistent, the floors of a
round count what its verify step and draft chain must move, and the synthetic acceptor reproduces vLLM's cumulative
per-position rates."""

from __future__ import annotations

import math

import pytest

from bench.bench_mtp import VLLM_RATES, expected_accepted, full_depth_floors, host_only, main, simulate_accepted
from bench.mtp_models import build, build_trunk
from bench.proxy import cache_ops, chain_ops, depth_ops, step_bytes
from inkling_kernels.fp8_head import preferred as fp8_preferred


def test_tiny_cpu_run_reports_every_batch_and_depth(capsys) -> None:
    rows = main(["--device", "cpu", "--batches", "1", "3", "--ctx", "20", "--depths", "1", "3"])
    out = capsys.readouterr().out
    assert [(r.batch, r.depth) for r in rows] == [(1, 1), (1, 3), (3, 1), (3, 3)]
    for r in rows:
        assert r.verify_ms > 0 and r.chain_ms > 0 and r.plain_ms > 0 and r.floor_ms > 0
        assert r.rows == 1 + round(expected_accepted(r.depth))
        assert 1 <= r.tokens_per_round <= 1 + r.depth
        assert r.per_token_ms == pytest.approx((r.verify_ms + r.chain_ms) / r.tokens_per_round)
        assert r.plain_graph_ms is None and r.speedup == pytest.approx(r.plain_ms / r.per_token_ms)  # CPU: no graphs
        assert 0 < r.lm_plain_ms and 0 < r.lm_verify_ms
        assert r.full_depth_speedup(1.0) == pytest.approx(r.speedup)  # no scaling: the measured figure
        assert r.verify_floor_ms > r.floor_ms and r.chain_floor_ms > 0
        assert r.verify_roofline_ms >= r.verify_floor_ms * (1 - 1e-12)  # per op max(bytes, FLOPs): never below
        assert r.chain_roofline_ms >= r.chain_floor_ms * (1 - 1e-12)
        assert r.per_token_floor_ms == pytest.approx((r.verify_floor_ms + r.chain_floor_ms) / r.tokens_per_round)
        assert r.floor_speedup == pytest.approx(r.plain_ms / r.per_token_floor_ms)
        assert r.floor_to_floor == pytest.approx(r.floor_ms / r.per_token_floor_ms)
        assert r.verify_over_floor == pytest.approx(r.verify_ms / r.verify_floor_ms)
        assert r.chain_over_floor == pytest.approx(r.chain_ms / r.chain_floor_ms)
        assert r.round_budget_ms(1.0) == pytest.approx(r.plain_ms * r.tokens_per_round)
        assert f"# B={r.batch} D={r.depth}: verify" in out and f"# B={r.batch} D={r.depth} floors: verify" in out
    for shallow, deep in ((rows[0], rows[1]), (rows[2], rows[3])):  # D=1 then D=3 of one B
        assert deep.verify_floor_ms > shallow.verify_floor_ms and deep.chain_floor_ms > 2 * shallow.chain_floor_ms
    assert "one-token byte floor" in out and "# B=3: best D=" in out and "at 42 layers" in out
    floor_lines = [line for line in out.splitlines() if " floors: " in line]
    assert len(floor_lines) == 4 and all(("goal 1.5x: round <=" in line) == ("B=1 " in line) for line in floor_lines)


def test_deep_proxy_gives_the_marginal_layers_estimate(capsys) -> None:
    """`--deep-layers`: the deeper trunk's plain and verify steps are timed per (B, D), and the estimate is the
    extrapolation of what its extra layers add (at the deep trunk's own depth it is that trunk's figure)."""
    (r,) = main(["--device", "cpu", "--batches", "2", "--ctx", "12", "--depths", "2", "--deep-layers", "12"])
    out = capsys.readouterr().out
    assert r.deep_layers == 12 and r.deep_plain_ms > 0 and r.deep_verify_ms > 0
    assert r.marginal_speedup(6) == pytest.approx(r.speedup)  # no extra layers: the measured figure
    own = r.deep_plain_ms / ((r.deep_verify_ms + r.draft_ms) / r.tokens_per_round)
    assert r.marginal_speedup(12) == pytest.approx(own)
    k = (42 - 6) / (12 - 6)
    base, verify = r.plain_ms + k * (r.deep_plain_ms - r.plain_ms), r.verify_ms + k * (r.deep_verify_ms - r.verify_ms)
    assert r.marginal_speedup(42) == pytest.approx(base * r.tokens_per_round / (verify + r.draft_ms))
    assert "(from the 12-layer proxy, plain" in out and "# B=2: at 42 layers from the 12-layer proxy best D=2" in out
    assert build_trunk("cpu", 12)[0].config.num_layers == 12


def test_full_floors_bound_the_whole_model(capsys) -> None:
    """`--full-floors` (the 42-layer model on the meta device): at B=1 each draft's verify row routes to more experts,
    so the bound falls again past a few drafts, at B=64 the rows share the experts the batch already reads; the FP8
    head's half bytes per depth raise it; the ratio does not depend on the bandwidth the times are printed at."""
    fp8 = full_depth_floors([1, 64], 1024, [1, 4, 8], "fp8")
    out = capsys.readouterr().out
    assert fp8[1, 8] < fp8[1, 4] and fp8[64, 1] < fp8[64, 4] < fp8[64, 8]
    assert max(fp8[64, d] for d in (1, 4, 8)) > max(fp8[1, d] for d in (1, 4, 8)) > 1
    bf16 = full_depth_floors([1], 1024, [4], "bf16")
    assert bf16[1, 4] < fp8[1, 4]
    assert full_depth_floors([1], 1024, [4], "fp8", gbs=1000.0)[1, 4] == pytest.approx(fp8[1, 4])
    assert "# full depth (42 layers, fp8 draft head" in out and "B=64 plain" in out and "best D=8" in out
    assert main(["--full-floors", "--batches", "1", "--depths", "2"]) == []


def test_verify_floor_reads_each_sequence_history_once() -> None:
    """D+1 rows per sequence add only the new rows' terms to the plain step's floor: their embeddings, their K/V
    written (the history is read once per sequence, not once per row) and their fp32 logits; weights and the
    (here fixed) routed experts stay. Each row scores the keys it sees, causal within the new rows."""
    trunk, _ = build("cpu", 1)
    config = trunk.config
    touched = {i: 2 for i, layer in enumerate(trunk.layers) if hasattr(layer.mlp, "experts")}
    b, ctx = 3, 40
    kv_row = sum(2 * config.layer_geometry(layer).kv_width * 2 for layer in range(config.num_layers))
    per_row = config.hidden_size * 2 + kv_row + config.unpadded_vocab_size * 4
    plain = step_bytes(trunk, b, ctx, touched)
    for width in (2, 5):
        assert step_bytes(trunk, b, ctx, touched, width) - plain == b * (width - 1) * per_row
    sliding, glob = config.layer_geometry(0), config.layer_geometry(config.num_layers - 1)
    assert sliding.window is not None and sliding.window < ctx and glob.window is None
    (kv_bytes, kv_flops), _ = cache_ops(config, 0, b, ctx, 4)
    assert kv_bytes == b * (sliding.window - 1 + 4) * 2 * sliding.kv_width * 2  # W-1 history rows + 4 new
    assert kv_flops == 4 * b * sliding.num_heads * 4 * sliding.window * sliding.head_dim
    (kv_bytes, kv_flops), _ = cache_ops(config, config.num_layers - 1, b, ctx, 4)
    assert kv_bytes == b * (ctx + 4) * 2 * glob.kv_width * 2
    assert kv_flops == 4 * b * glob.num_heads * (41 + 42 + 43 + 44) * glob.head_dim


def test_chain_floor_is_its_depths_floors() -> None:
    """Depth j of a round runs the verified rows and j provisional ones: the chain is the sum of its depths, and two
    depths of equal shapes differ only by those rows' embeddings and K/V writes; each depth reads the bf16 lm_head
    for its B drafts, or the FP8 copy and its row scales at the row counts where the drafter uses it."""
    trunk, drafter = build("cpu", 3)
    config = drafter.config
    b, ctx, rows = 2, 40, 2

    def depth_bytes(depth: int, rows: int, batch: int = b) -> int:
        return sum(n for n, _ in depth_ops(drafter, depth, batch, ctx, rows))

    assert config.sliding_layers == (True, False, True)
    geo = config.layer_geometry(0)
    per_row = b * (config.hidden_size * 2 + 2 * geo.kv_width * 2)  # an embedding row and a K/V row per sequence
    assert (
        depth_bytes(2, rows) == depth_bytes(0, rows) and depth_bytes(2, rows + 2) == depth_bytes(0, rows) + 2 * per_row
    )
    assert sum(n for n, _ in chain_ops(drafter, b, ctx, rows, 1)) == depth_bytes(0, rows)
    chain = sum(n for n, _ in chain_ops(drafter, b, ctx, rows, 3))
    assert chain == depth_bytes(0, rows) + depth_bytes(1, rows + 1) + depth_bytes(2, rows + 2)
    many = next(m for m in range(1, 1024) if not fp8_preferred(m))  # the first row count on the bf16 head
    bf16 = {batch: depth_bytes(0, rows, batch) for batch in (1, many)}
    drafter.use_fp8_head()
    vocab, h = config.unpadded_vocab_size, config.hidden_size
    head_change = vocab * h + 4 * vocab - trunk.unembed.weight.numel() * 2  # e4m3 rows + fp32 scales vs bf16
    assert depth_bytes(0, rows, 1) == bf16[1] + head_change and head_change < 0
    assert depth_bytes(0, rows, many) == bf16[many]  # those rows draft through the bf16 head


def test_host_only_times_a_round_per_batch_and_depth(capsys) -> None:
    figures = host_only("cpu", [1, 3], 20, [3, 1], reps=3)
    out = capsys.readouterr().out
    assert set(figures) == {(1, 3), (1, 1), (3, 3), (3, 1)} and all(ms > 0 for ms in figures.values())
    assert "# host only: B=3 D=1 (2 rows/seq)" in out
    with pytest.raises(ValueError, match="--host-only"):
        host_only("cpu", [1], 0, [1], reps=1)


def test_synthetic_acceptor_follows_the_published_cumulative_rates() -> None:
    rounds, sequences = 4000, 8
    n = rounds * sequences
    mean = simulate_accepted(8, sequences, rounds, seed=1)
    sd = math.sqrt(
        sum(p * (1 - p) for p in VLLM_RATES)
        + 2
        * sum(  # accepted = sum of correlated indicators
            min(p, q) - p * q for i, p in enumerate(VLLM_RATES) for q in VLLM_RATES[i + 1 :]
        )
    )
    assert abs(mean - expected_accepted(8)) < 5 * sd / math.sqrt(n)
    assert expected_accepted(8) == pytest.approx(3.40, abs=0.005)  # vLLM's MTP8 accepted length 4.40 = 1 + 3.40
    assert simulate_accepted(1, sequences, rounds) == pytest.approx(VLLM_RATES[0], abs=5 * 0.43 / math.sqrt(n))


def test_bad_arguments_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--depths"):
        main(["--device", "cpu", "--depths", "9"])
    with pytest.raises(ValueError, match="--ctx"):
        main(["--device", "cpu", "--ctx", "0"])
    with pytest.raises(ValueError, match="--deep-layers"):
        main(["--device", "cpu", "--deep-layers", "6"])
    with pytest.raises(SystemExit, match="--breakdown"):
        main(["--device", "cpu", "--breakdown"])  # no GPU kernels to break down
