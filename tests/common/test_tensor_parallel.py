"""The sharding plan as data: head/KV rules, expert partition, NVFP4 block boundaries, vocab padding, round trip."""

from __future__ import annotations

import pytest
import torch

from common.checkpoint_layout import decoder_tensor_shapes, mtp_tensor_shapes
from common.config import AttentionGeometry, parse_model_config
from common.errors import ConfigError
from common.tensor_parallel import (
    COLUMN,
    EXPERT,
    REPLICATED,
    ROW,
    Shard,
    assemble,
    head_shard,
    plan_all,
    plan_rank,
    split_evenly,
    take,
)
from tools.make_tiny_checkpoint import raw_config


def tiny(**overrides):
    return parse_model_config(raw_config(**overrides))


def geometry(heads: int, kv: int) -> AttentionGeometry:
    return AttentionGeometry(heads, kv, 16, 16, None, False)


def test_kv_heads_are_divided_or_replicated_like_sglang() -> None:
    # 8 query heads over 2 KV heads (groups of 4): TP=2 divides the KV heads, TP=4 and 8 replicate them.
    assert [head_shard(geometry(8, 2), 2, r, "global").kv for r in range(2)] == [(0, 1), (1, 2)]
    four = [head_shard(geometry(8, 2), 4, r, "global") for r in range(4)]
    assert [s.q for s in four] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.kv for s in four] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert {s.kv_replicas for s in four} == {2}
    for size in (1, 2, 4, 8):  # every query head of a rank uses a KV head the rank holds
        for r in range(size):
            s = head_shard(geometry(8, 2), size, r, "global")
            assert {q // 4 for q in range(*s.q)} <= set(range(*s.kv))


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ConfigError, match="does not divide the global layers' query heads"):
        head_shard(geometry(4, 1), 3, 0, "global")
    with pytest.raises(ConfigError, match="does not divide the sliding layers' key/value heads"):
        head_shard(geometry(12, 6), 4, 0, "sliding")
    with pytest.raises(ConfigError, match="not a multiple of them"):
        head_shard(geometry(12, 4), 6, 0, "global")
    with pytest.raises(ConfigError, match="query heads"):
        plan_rank(tiny(), 3, 0)  # make-tiny has 4 query heads
    with pytest.raises(ConfigError, match="rank=2"):
        plan_rank(tiny(), 2, 2)
    with pytest.raises(ConfigError, match="dense intermediate size of layer 0"):
        plan_rank(tiny(dense_intermediate_size=90), 4, 0)


def test_tp_beyond_the_global_kv_heads() -> None:
    config = tiny()  # global layers: 4 query heads, 1 KV head; sliding layers: 2 KV heads
    plans = plan_all(config, 4)
    assert [p.full.kv for p in plans] == [(0, 1)] * 4
    assert [p.sliding.kv for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    hd = config.text.head_dim
    assert {p.shards["layers.5.attn.wk_dv.weight"].ranges for p in plans} == {((0, hd),)}
    assert [p.shards["layers.5.attn.wq_du.weight"].ranges for p in plans] == [
        ((r * hd, (r + 1) * hd),) for r in range(4)
    ]


def test_split_evenly() -> None:
    assert [split_evenly(6, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [split_evenly(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert split_evenly(2, 4, 3) == (2, 2)


def test_rules_per_tensor() -> None:
    config = tiny()
    p = plan_rank(config, 2, 1)
    i, d = config.text.moe_intermediate_size, config.text.dense_intermediate_size
    assert p.shards["layers.0.mlp.w13_dn.weight"] == Shard(COLUMN, 0, ((d // 2, d), (d + d // 2, 2 * d)))
    assert p.shards["layers.0.mlp.w2_md.weight"] == Shard(ROW, 1, ((d // 2, d),))
    assert p.shards["layers.3.mlp.experts.w13_weight"] == Shard(COLUMN, 1, ((i // 2, i), (i + i // 2, 2 * i)))
    for key in ("attn.rel_logits_proj.proj", "attn_sconv.weight", "mlp_sconv.weight", "attn.q_norm.weight"):
        assert p.shards[f"layers.2.{key}"].rule == REPLICATED
    assert p.shards["layers.2.mlp.gate.weight"].rule == REPLICATED
    ep = plan_rank(config, 2, 1, expert_parallel=True)
    assert ep.experts == (4, 8) and ep.shards["layers.3.mlp.experts.w2_weight"] == Shard(EXPERT, 0, ((4, 8),))
    assert ep.shards["layers.3.mlp.shared_experts.shared_w2_weight"] == Shard(ROW, 2, ((i // 2, i),))


def test_nvfp4_slices_stay_on_scale_blocks() -> None:
    config = tiny(intermediate_size=64)
    p = plan_rank(config, 4, 3, nvfp4_layers=(3, 4))
    assert p.shards["layers.3.mlp.experts.w2_weight"] == Shard(ROW, 2, ((24, 32),))  # bytes: 2 codes each
    assert p.shards["layers.3.mlp.experts.w2_weight_scale"] == Shard(ROW, 2, ((3, 4),))  # 16-element blocks
    assert p.shards["layers.3.mlp.experts.w13_weight_scale"] == Shard(COLUMN, 1, ((48, 64), (112, 128)))
    assert p.shards["layers.3.mlp.experts.w2_weight_scale2"].rule == REPLICATED
    assert "layers.2.mlp.experts.w2_weight_scale" not in p.shards  # layer 2 is bf16
    with pytest.raises(ConfigError, match="not a whole number of 16-element scale blocks"):
        plan_rank(tiny(), 4, 0, nvfp4_layers=(3,))  # I=32 over 4 ranks: 8 K columns each
    assert plan_rank(tiny(), 4, 0, expert_parallel=True, nvfp4_layers=(3,)).shards[
        "layers.3.mlp.experts.w2_weight_scale2"
    ] == Shard(EXPERT, 0, ((0, 2),))
    with pytest.raises(ConfigError, match=r"layers \[0\] are not MoE layers"):
        plan_rank(tiny(), 2, 0, nvfp4_layers=(0,))


def test_vocab_shards_pad_the_last_rank() -> None:
    config = tiny(vocab_size=510, unpadded_vocab_size=500)
    plans = plan_all(config, 4)
    assert [p.vocab for p in plans] == [(0, 128), (128, 256), (256, 384), (384, 510)]
    assert {p.vocab_per_rank for p in plans} == {128} and {p.sample_vocab for p in plans} == {500}
    assert [p.shards["unembed.weight"].pad for p in plans] == [0, 0, 0, 2]
    assert {p.shards["unembed.weight"].local_shape((510, 64)) for p in plans} == {(128, 64)}


@pytest.mark.parametrize(("size", "ep"), [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_every_tensor_round_trips(size: int, ep: bool) -> None:
    config = tiny(vocab_size=510, unpadded_vocab_size=500, n_routed_experts=6)
    plans = plan_all(config, size, ep)
    gen = torch.Generator().manual_seed(size)
    for shapes, attr in ((decoder_tensor_shapes(config), "shards"), (mtp_tensor_shapes(config), "mtp_shards")):
        assert set(getattr(plans[0], attr)) == set(shapes)
        for key, shape in shapes.items():
            full = torch.randn(shape, generator=gen)
            shards = [getattr(p, attr)[key] for p in plans]
            local = [take(full, s) for s in shards]
            assert {tuple(x.shape) for x in local} == {shards[0].local_shape(shape)} or shards[0].rule == EXPERT
            assert torch.equal(assemble(shards, local, full.shape[shards[0].dim or 0]), full), key


def test_assemble_rejects_disagreeing_replicas() -> None:
    config = tiny()
    plans = plan_all(config, 2)
    shards = [p.shards["layers.5.attn.wk_dv.weight"] for p in plans]  # the one global KV head, on both ranks
    a, b = torch.randn(16, 64), torch.randn(16, 64)
    with pytest.raises(ValueError, match="ranks disagree"):
        assemble(shards, [a, b])
    with pytest.raises(ValueError, match="replicated tensor differs"):
        assemble([Shard(REPLICATED)] * 2, [a, b])
