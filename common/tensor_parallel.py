"""Tensor / expert parallelism as data: which slice of every in-memory weight rank r of N holds (issue 14).

Keys are the in-memory names of ARCHITECTURE.md (decoder: prefix `model.llm.` stripped; MTP: `model.mtp.`
stripped). A `Shard` says along which dim of the full in-memory tensor (gate/up already de-interleaved) the rank
holds which ranges, concatenated in order. The rules (what SGLang, vLLM and TensorRT-LLM do for Inkling):

- attention: `wq_du`, `wk_dv`, `wv_dv`, `wr_du` column-parallel by head (dim 0), `wo_ud` row-parallel (dim 1,
  then all-reduce). TP must divide each layer kind's query heads. Where TP exceeds a kind's KV heads, each KV head
  is replicated on TP / nKV ranks and rank r holds KV head r // (TP / nKV) (SGLang's `QKVParallelLinear`), which
  is the KV head of its query heads; otherwise TP must divide nKV. `k_sconv` / `v_sconv` go with their KV heads;
  `q_norm` / `k_norm` are one `[hd]` weight shared by every head, so each rank holds all of it; the relative-bias
  bank `[d_rel, R]` is replicated.
- the residual short convs (`attn_sconv`, `mlp_sconv`) and every norm run on the full hidden: replicated.
- dense MLP and shared experts: column-parallel over the intermediate size for w13 (the rank's gate rows and the
  same up rows, so its local w13 is again `[gate; up]`), row-parallel for w2.
- routed experts: by default TP over the intermediate size like the shared experts. NVFP4 stacks are sliced in
  their packed units: w13 rows (packed codes and block scales alike, both along the output rows), w2 along K,
  where 2 codes share a byte and one e4m3 scale covers 16 elements, so each rank's K-slice must be a whole
  number of 16-element blocks; `scale2` (one per expert) is replicated. With `expert_parallel`, experts are
  partitioned over ranks instead (the first E % N ranks get one more) with all their tensors, `scale2` too;
  the router (`mlp.gate.*`) is replicated in both modes.
- embedding and lm_head: vocab-parallel over the PADDED vocab in ceil(V / N) rows per rank; the last rank's
  rows past V are zero padding, so every rank's shard has the same shape for the logits all-gather. The gathered
  logits have N * ceil(V / N) columns in vocab order; sampling reads only the first `sample_vocab`
  (= `unpadded_vocab_size`) of them.
- MTP depths: each depth's `transformer_block.*` shards like a trunk layer of its kind with a dense MLP; its
  norms, `input_proj` (`[H, 2H]` to the full hidden, SGLang's replicated `eh_proj`) and `chain_norm` are
  replicated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from common.config import AttentionGeometry, ModelConfig, TextConfig
from common.errors import ConfigError
from common.nvfp4 import BLOCK_SIZE

REPLICATED, COLUMN, ROW, VOCAB, EXPERT = "replicated", "column", "row", "vocab", "expert"


@dataclass(frozen=True)
class Shard:
    """The part of one full tensor a rank holds: `ranges` along `dim`, concatenated, then `pad` zero rows."""

    rule: str
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    pad: int = 0

    def local_shape(self, full: Sequence[int]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full)
        shape = list(full)
        shape[self.dim] = sum(b - a for a, b in self.ranges) + self.pad
        return tuple(shape)


@dataclass(frozen=True)
class HeadShard:
    """The heads of one layer kind a rank holds: query heads `q` and KV heads `kv`, each `[start, stop)`."""

    q: tuple[int, int]
    kv: tuple[int, int]
    kv_replicas: int  # ranks that hold each of these KV heads

    @property
    def num_q(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def num_kv(self) -> int:
        return self.kv[1] - self.kv[0]


@dataclass(frozen=True)
class RankPlan:
    """Everything rank `rank` of `size` holds; `shards` (decoder) and `mtp_shards` cover every in-memory key."""

    rank: int
    size: int
    expert_parallel: bool
    nvfp4_layers: tuple[int, ...]
    sliding: HeadShard
    full: HeadShard  # global layers
    vocab: tuple[int, int]  # rows of the padded vocab held (the rest of the rank's rows is padding)
    vocab_per_rank: int
    sample_vocab: int  # first columns of the gathered logits that may be sampled (the unpadded vocab)
    experts: tuple[int, int]  # routed experts held (all of them unless expert parallel)
    shards: dict[str, Shard] = field(repr=False)
    mtp_shards: dict[str, Shard] = field(repr=False)

    def heads(self, sliding: bool) -> HeadShard:
        return self.sliding if sliding else self.full


# ----------------------------------------------------------------------------------------------------
# Validation and the per-rank pieces


def _check_size(size: int, rank: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size={size!r}: expected an integer >= 1")
    if not 0 <= rank < size:
        raise ConfigError(f"rank={rank!r}: expected 0 <= rank < tensor_parallel_size={size}")


def head_shard(g: AttentionGeometry, size: int, rank: int, kind: str) -> HeadShard:
    """Query and KV heads of rank `rank` for one layer kind (SGLang's KV replication where size > nKV)."""
    if g.num_heads % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the {kind} layers' query heads ({g.num_heads})")
    per_q = g.num_heads // size
    q = (rank * per_q, (rank + 1) * per_q)
    if size <= g.num_kv_heads:
        if g.num_kv_heads % size:
            raise ConfigError(
                f"tensor_parallel_size={size} does not divide the {kind} layers' key/value heads ({g.num_kv_heads})"
            )
        per_kv = g.num_kv_heads // size
        return HeadShard(q, (rank * per_kv, (rank + 1) * per_kv), 1)
    if size % g.num_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size={size} exceeds the {kind} layers' key/value heads ({g.num_kv_heads}) "
            "and is not a multiple of them (each KV head must be replicated on the same number of ranks)"
        )
    replicas = size // g.num_kv_heads
    kv = rank // replicas
    group = g.num_heads // g.num_kv_heads
    assert q[0] // group == kv and (q[1] - 1) // group == kv, "query heads of a rank must share its KV head"
    return HeadShard(q, (kv, kv + 1), replicas)


def split_evenly(n: int, size: int, rank: int) -> tuple[int, int]:
    """`[start, stop)` of rank `rank` when n items are partitioned over `size` ranks (the first n % size get one
    more)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _intermediate(n: int, size: int, rank: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide {what} ({n})")
    per = n // size
    return rank * per, (rank + 1) * per


def _column(start: int, stop: int, scale: int = 1, dim: int = 0) -> Shard:
    return Shard(COLUMN, dim, ((start * scale, stop * scale),))


def _gate_up(start: int, stop: int, n: int, dim: int) -> Shard:
    """The rank's gate rows and the same up rows of a `[gate; up]` tensor with `n` rows per half."""
    return Shard(COLUMN, dim, ((start, stop), (n + start, n + stop)))


_REPLICATED = Shard(REPLICATED)


def layer_shards(
    text: TextConfig,
    sliding: bool,
    dense: bool,
    heads: HeadShard,
    size: int,
    rank: int,
    expert_parallel: bool = False,
    nvfp4: bool = False,
    where: str = "layer",
) -> dict[str, Shard]:
    """Shards of one decoder layer's tensors (keys as in `layer_tensor_shapes`, plus NVFP4 sidecar keys)."""
    g = text.geometry(sliding)
    (q0, q1), (k0, k1) = heads.q, heads.kv
    out = {
        "attn_norm.weight": _REPLICATED,
        "mlp_norm.weight": _REPLICATED,
        "attn.wq_du.weight": _column(q0, q1, g.head_dim),
        "attn.wk_dv.weight": _column(k0, k1, g.head_dim),
        "attn.wv_dv.weight": _column(k0, k1, g.head_dim),
        "attn.wr_du.weight": _column(q0, q1, text.d_rel),
        "attn.wo_ud.weight": Shard(ROW, 1, ((q0 * g.head_dim, q1 * g.head_dim),)),
        "attn.q_norm.weight": _REPLICATED,
        "attn.k_norm.weight": _REPLICATED,
        "attn.k_sconv.weight": _column(k0, k1, g.head_dim),
        "attn.v_sconv.weight": _column(k0, k1, g.head_dim),
        "attn.rel_logits_proj.proj": _REPLICATED,
        "attn_sconv.weight": _REPLICATED,
        "mlp_sconv.weight": _REPLICATED,
    }
    if dense:
        d = text.dense_intermediate_size
        a, b = _intermediate(d, size, rank, f"the dense intermediate size of {where}")
        out |= {
            "mlp.w13_dn.weight": _gate_up(a, b, d, 0),
            "mlp.w2_md.weight": Shard(ROW, 1, ((a, b),)),
            "mlp.global_scale": _REPLICATED,
        }
        return out
    i = text.moe_intermediate_size
    a, b = _intermediate(i, size, rank, f"the expert intermediate size of {where}")
    out |= {
        "mlp.gate.weight": _REPLICATED,
        "mlp.gate.bias": _REPLICATED,
        "mlp.gate.global_scale": _REPLICATED,
        "mlp.shared_experts.shared_w13_weight": _gate_up(a, b, i, 1),
        "mlp.shared_experts.shared_w2_weight": Shard(ROW, 2, ((a, b),)),
    }
    stacks = ("mlp.experts.w13_weight", "mlp.experts.w2_weight")
    keys = [s + suffix for s in stacks for suffix in (("", "_scale", "_scale2") if nvfp4 else ("",))]
    if expert_parallel:
        e = split_evenly(text.n_routed_experts, size, rank)
        return out | {k: Shard(EXPERT, 0, (e,)) for k in keys}
    out["mlp.experts.w13_weight"] = _gate_up(a, b, i, 1)
    out["mlp.experts.w2_weight"] = Shard(ROW, 2, ((a, b),))
    if nvfp4:
        if (b - a) % BLOCK_SIZE:
            raise ConfigError(
                f"tensor_parallel_size={size}: NVFP4 routed experts of {where} would give each rank {b - a} of "
                f"the {i} K columns of w2, not a whole number of {BLOCK_SIZE}-element scale blocks "
                "(use a smaller size or expert parallelism)"
            )
        out |= {
            "mlp.experts.w13_weight_scale": _gate_up(a, b, i, 1),
            "mlp.experts.w13_weight_scale2": _REPLICATED,
            "mlp.experts.w2_weight": Shard(ROW, 2, ((a // 2, b // 2),)),  # two codes per byte
            "mlp.experts.w2_weight_scale": Shard(ROW, 2, ((a // BLOCK_SIZE, b // BLOCK_SIZE),)),
            "mlp.experts.w2_weight_scale2": _REPLICATED,
        }
    return out


# ----------------------------------------------------------------------------------------------------
# The plan of one rank


def plan_rank(
    config: ModelConfig,
    size: int,
    rank: int,
    expert_parallel: bool = False,
    nvfp4_layers: Iterable[int] = (),
) -> RankPlan:
    """The shards of rank `rank` of `size` for every decoder (and MTP) tensor; `nvfp4_layers` are the layers whose
    routed experts are stored in NVFP4 (`LoadReport.nvfp4_layers`)."""
    _check_size(size, rank)
    t = config.text
    nvfp4 = tuple(sorted(set(nvfp4_layers)))
    bad = [i for i in nvfp4 if not 0 <= i < t.num_layers or t.dense_layers[i]]
    if bad:
        raise ConfigError(f"nvfp4_layers: layers {bad} are not MoE layers of this config")
    sliding = head_shard(t.geometry(True), size, rank, "sliding")
    full = head_shard(t.geometry(False), size, rank, "global")
    per_vocab = math.ceil(t.vocab_size / size)
    v0 = min(rank * per_vocab, t.vocab_size)
    v1 = min(v0 + per_vocab, t.vocab_size)
    vocab_shard = Shard(VOCAB, 0, ((v0, v1),), per_vocab - (v1 - v0))
    shards = {
        "embed.weight": vocab_shard,
        "embed_norm.weight": _REPLICATED,
        "norm.weight": _REPLICATED,
        "unembed.weight": vocab_shard,
    }
    for i in range(t.num_layers):
        s = t.sliding_layers[i]
        layer = layer_shards(
            t, s, t.dense_layers[i], sliding if s else full, size, rank, expert_parallel, i in nvfp4, f"layer {i}"
        )
        shards |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    mtp_shards: dict[str, Shard] = {}
    if config.mtp is not None:
        for d, s in enumerate(config.mtp.sliding_layers):
            p = f"layers.{d}."
            mtp_shards |= {p + k: _REPLICATED for k in ("hidden_norm.weight", "embed_norm.weight", "input_proj.weight")}
            block = layer_shards(t, s, True, sliding if s else full, size, rank, where=f"MTP depth {d}")
            mtp_shards |= {p + "transformer_block." + k: v for k, v in block.items()}
        if config.mtp.chain_hidden_post_norm:
            mtp_shards["chain_norm.weight"] = _REPLICATED
    experts = split_evenly(t.n_routed_experts, size, rank) if expert_parallel else (0, t.n_routed_experts)
    return RankPlan(
        rank=rank,
        size=size,
        expert_parallel=expert_parallel,
        nvfp4_layers=nvfp4,
        sliding=sliding,
        full=full,
        vocab=(v0, v1),
        vocab_per_rank=per_vocab,
        sample_vocab=t.unpadded_vocab_size,
        experts=experts,
        shards=shards,
        mtp_shards=mtp_shards,
    )


def plan_all(
    config: ModelConfig, size: int, expert_parallel: bool = False, nvfp4_layers: Iterable[int] = ()
) -> list[RankPlan]:
    nvfp4 = tuple(nvfp4_layers)
    return [plan_rank(config, size, r, expert_parallel, nvfp4) for r in range(size)]


# ----------------------------------------------------------------------------------------------------
# Applying a shard to full tensors, and back


def take(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The rank's local tensor cut from a full tensor (used to generate or check shards)."""
    if shard.dim is None:
        return full.clone()
    pieces = [full.narrow(shard.dim, a, b - a) for a, b in shard.ranges]
    if shard.pad:
        shape = list(full.shape)
        shape[shard.dim] = shard.pad
        pieces.append(full.new_zeros(shape))
    return torch.cat(pieces, dim=shard.dim)


def assemble(shards: Sequence[Shard], locals_: Sequence[torch.Tensor], full_size: int | None = None) -> torch.Tensor:
    """The full tensor from every rank's local tensor. Pieces held by several ranks (replicated tensors and KV
    heads, shared vocab padding) must agree exactly; `full_size` (along the sharded dim) defaults to the end of
    the last range."""
    first = shards[0]
    if first.dim is None:
        for r, (s, x) in enumerate(zip(shards, locals_, strict=True)):
            if s.dim is not None or not torch.equal(x, locals_[0]):
                raise ValueError(f"replicated tensor differs on rank {r}")
        return locals_[0]
    dim = first.dim
    n = full_size if full_size is not None else max(b for s in shards for _, b in s.ranges)
    shape = list(locals_[0].shape)
    shape[dim] = n
    out = locals_[0].new_zeros(shape)
    seen = torch.zeros(n, dtype=torch.bool)
    for r, (s, x) in enumerate(zip(shards, locals_, strict=True)):
        assert s.dim == dim, f"rank {r} shards along dim {s.dim}, rank 0 along {dim}"
        offset = 0
        for a, b in s.ranges:
            piece = x.narrow(dim, offset, b - a)
            if seen[a:b].any() and not torch.equal(out.narrow(dim, a, b - a), piece):
                raise ValueError(f"ranks disagree on [{a}, {b}) (rank {r})")
            out.narrow(dim, a, b - a).copy_(piece)
            seen[a:b] = True
            offset += b - a
        if s.pad and x.narrow(dim, offset, s.pad).count_nonzero():
            raise ValueError(f"rank {r}: padding rows are not zero")
    if not seen.all():
        raise ValueError(f"no rank holds {int((~seen).sum())} of the {n} entries along dim {dim}")
    return out
