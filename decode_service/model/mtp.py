"""The checkpoint's MTP drafter (spec/inkling-text.md 1.5, 6.6, 7.1-7.2): D chained depths over packed batches.

One depth d, for the rows of a `ForwardBatch` whose `token_ids` are the tokens paired with those rows:

    e   = embed_norm_d(backbone_embed_norm(E[tok]))                  # backbone norm FIRST (SG/VL, spec 7.6)
    x   = input_proj_d([hidden_norm_d(g_{d-1}); e])                  # hidden part first
    g_d = DecoderLayer_d(x)                                          # a trunk layer with a dense MLP
    g_d = chain_norm(g_d)          only when chain_hidden_post_norm  # one norm shared by all depths
    logits_d = U (g_d / mup)[:, :Vu]                                 # the trunk's lm_head, no final norm

`g_{-1}` is the trunk's final-normed hidden `y`. The embedding, its backbone norm and the unembedding are the
trunk's own modules (shared, not copied). Each depth is a trunk `DecoderLayer` built from `depth_config`, a
`TextConfig` with one "layer" per depth (its sliding/global kind, dense MLP, the depths' window), so depth d reads
and writes `seq.layers[d]` of the batch exactly like trunk layer d would: the engine gives the drafter its own
per-request caches (`new_state()`, or paged pools of the depths' geometry) and runs one depth per forward.
Positions are the trunk row positions at every depth (SG's convention, spec 7.2).

Multimodal prompts: `forward` refuses `mm_rows`; the engine pairs a media placeholder row with the placeholder
token's embedding and the media reach the depths through the trunk's hidden at those rows (docs/decisions.md).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from common.config import MtpConfig, TextConfig
from common.errors import CheckpointError
from common.settings import MTP_DRAFT_HEADS
from decode_service.model.backend import PreparedBatch
from decode_service.model.batch import ForwardBatch
from decode_service.model.collectives import SINGLE, TPGroup
from decode_service.model.inkling import InklingDecoder
from decode_service.model.layers import DecoderLayer, RMSNorm
from decode_service.model.ops import Ops
from decode_service.model.state import SequenceState
from inkling_kernels.fp8_head import preferred as fp8_preferred
from inkling_kernels.fp8_head import quantize_rows_fp8

_ATTN_INPUTS = ("wq_du", "wk_dv", "wv_dv", "wr_du")  # the checkpoint's rows of `attn.qkvr`, in this order
_FP32 = "sconv.weight"  # conv weights stay fp32 (spec 4.2)
_SHARED = ("embed.", "embed_norm.", "unembed.")  # the trunk's tensors


def _checkpoint_names(key: str) -> list[str]:
    """The checkpoint tensors (in `load_mtp_weights` naming) that make up one drafter state-dict entry."""
    if key.endswith("attn.qkvr.weight"):
        return [key.replace("qkvr", p) for p in _ATTN_INPUTS]
    return [key]


def depth_config(text: TextConfig, mtp: MtpConfig) -> TextConfig:
    """The text config seen by the depths: one layer per depth, all dense, sliding per `mtp.local_layer_ids`, the
    depths' window (`local_extent`, else the trunk's)."""
    n = mtp.num_layers
    return dataclasses.replace(
        text,
        num_layers=n,
        sliding_layers=mtp.sliding_layers,
        dense_layers=(True,) * n,
        sliding_window=mtp.window,
    )


class MTPDepth(nn.Module):
    """Norms and input projection of one depth, then its decoder layer (layer index = depth)."""

    def __init__(self, config: TextConfig, depth: int, ops: Ops, tp: TPGroup = SINGLE):
        super().__init__()
        h = config.hidden_size
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps, ops)
        self.embed_norm = RMSNorm(h, config.rms_norm_eps, ops)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.transformer_block = DecoderLayer(config, depth, ops, nvfp4=False, tp=tp)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, step: PreparedBatch) -> torch.Tensor:
        """hidden `[T, H]` previous hidden, embedded `[T, H]` backbone-normed token embeddings -> `[T, H]`."""
        x = self.input_proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(embedded)], dim=-1))  # [T, 2H]->[T, H]
        return self.transformer_block(x, step)


class MTPDrafter(nn.Module):
    """All D depths of the checkpoint's drafter. `embed`, `embed_norm` and `unembed` are the trunk's modules
    (registered here too, not copied); everything else belongs to the drafter."""

    def __init__(self, mtp: MtpConfig, trunk: InklingDecoder):
        super().__init__()
        self.mtp = mtp
        self.config = depth_config(trunk.config, mtp)
        self.embed, self.embed_norm, self.unembed = trunk.embed, trunk.embed_norm, trunk.unembed
        self.ops = trunk.ops
        self.fp8_head: tuple[torch.Tensor, torch.Tensor] | None = None  # `use_fp8_head`: (e4m3 rows, row scales)
        self._prepare = trunk.prepare  # the trunk's attention backends, chosen at its build
        self.tp = trunk.tp  # a tensor-parallel trunk's rank: the depths shard like its layers
        self.layers = nn.ModuleList(MTPDepth(self.config, d, trunk.ops, self.tp) for d in range(mtp.num_layers))
        h, eps = self.config.hidden_size, self.config.rms_norm_eps
        self.chain_norm = RMSNorm(h, eps, trunk.ops) if mtp.chain_hidden_post_norm else None

    @classmethod
    def from_weights(
        cls, weights: dict[str, torch.Tensor], mtp: MtpConfig, trunk: InklingDecoder, head: str = "bf16"
    ) -> MTPDrafter:
        """Adopt exactly the tensors of `common.checkpoint.load_mtp_weights` (prefix `model.mtp.` stripped, w13
        de-interleaved), cast to the trunk's dtype (convs fp32) on its device; a missing or unexpected tensor
        raises `CheckpointError` naming it. `head` (`MTP_DRAFT_HEADS`): "fp8" builds the FP8 draft head now."""
        if head not in MTP_DRAFT_HEADS:
            raise ValueError(f"head: expected one of {MTP_DRAFT_HEADS}, got {head!r}")
        with torch.device("meta"):
            model = cls(mtp, trunk)
        owned = [k for k in model.state_dict() if not k.startswith(_SHARED)]
        expected = {n for k in owned for n in _checkpoint_names(k)}
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        if missing or unexpected:
            raise CheckpointError(f"MTP drafter weights: missing {missing}, unexpected {unexpected}")
        device, dtype = trunk.embed.weight.device, trunk.dtype
        state = {
            key: torch.cat([weights[n] for n in _checkpoint_names(key)]).to(
                device=device, dtype=torch.float32 if key.endswith(_FP32) else dtype
            )
            for key in owned
        }
        model.load_state_dict(state, strict=False, assign=True)
        assert not any(p.is_meta for p in model.parameters()), "every drafter parameter is adopted"
        if head == "fp8":
            model.use_fp8_head()
        return model.eval()

    @torch.no_grad()
    def use_fp8_head(self) -> None:
        """Draft logits from now on through an FP8 copy of the shared lm_head (e4m3, one fp32 scale per vocabulary
        row: `inkling_kernels.fp8_head`), half the bytes the chain reads per depth. Memory: +V*H bytes (+4V), e.g. 0.82
        GB for Inkling-Small's 201024 x 4096 (0.8 GB on one rank: only the unpadded rows; a vocab-parallel rank keeps
        its whole shard). The served output does not depend on it: drafts are verified against the trunk."""
        weight = self.unembed.weight
        rows = weight if self.tp.size > 1 else weight[: self.config.unpadded_vocab_size]
        self.fp8_head = quantize_rows_fp8(rows)

    @property
    def num_depths(self) -> int:
        return len(self.layers)

    def new_state(self) -> SequenceState:
        """Fresh caches for one sequence: per depth its KV (the depth's geometry) and 4 conv states."""
        weight = self.embed.weight
        return SequenceState.fresh(self.config, device=weight.device, conv_dtype=weight.dtype)

    def forward(self, depth: int, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Depth `depth` over the packed rows of `batch` -> its output hidden `[T, H]` (after chain_norm when
        enabled): the next depth's `hidden` and, through `logits`, this depth's drafts.

        `hidden` `[T, H]`: the trunk's final-normed rows for depth 0, the previous depth's output otherwise;
        `batch.token_ids` the token paired with each row (t_{i+d+1} at row i); `batch.sequences[*].layers` the
        drafter's caches (index = depth), `batch.decode` its paged pools.
        """
        if not 0 <= depth < self.num_depths:
            raise ValueError(f"depth: expected 0..{self.num_depths - 1}, got {depth}")
        if batch.mm_rows is not None:
            raise ValueError("batch.mm_rows: multimodal rows are not supported by the MTP drafter yet")
        if hidden.shape != (batch.num_tokens, self.config.hidden_size):
            raise ValueError(
                f"hidden: expected shape {(batch.num_tokens, self.config.hidden_size)}, got {tuple(hidden.shape)}"
            )
        embedded = self.embed_norm(
            self.tp.embed(self.embed, batch.token_ids)
        )  # [T, H], the backbone norm first (spec 7.1)
        g = self.layers[depth](hidden, embedded, self._prepare(batch))
        return self.chain_norm(g) if self.chain_norm is not None else g

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, H]` depth outputs -> fp32 draft logits `[N, unpadded_vocab]` (no final norm, spec 7.1 step 6): the
        shared lm_head, or its FP8 copy after `use_fp8_head` for the row counts where it is faster
        (`inkling_kernels.fp8_head.preferred`: up to 64 rows; the same muP division). Every draft and its distribution q
        come from these logits."""
        mup, vocab = self.config.mup_multiplier, self.config.unpadded_vocab_size
        if self.uses_fp8_head(hidden.shape[0]):
            weight, scale = self.fp8_head
            return self.ops.fp8_logits(hidden, weight, scale, mup, self.tp, vocab)
        return self._product(hidden).float()

    def argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`logits(hidden).argmax(-1)` as int64 `[N]` (the greedy drafts), through the ops' row argmax (exactly
        torch's: the first of equal values): on the bf16 head of the same bf16 product without its fp32 copy (the
        cast is exact: the same values, ties and first index), on the FP8 head of its logits. Not the ops' fused
        `argmax_logits`: at one row that is the skinny GEMV's product, not this head's cuBLAS one (decisions.md)."""
        if self.uses_fp8_head(hidden.shape[0]):
            return self.ops.argmax_rows(self.logits(hidden))
        return self.ops.argmax_rows(self._product(hidden))

    def _product(self, hidden: torch.Tensor) -> torch.Tensor:
        z = hidden / self.config.mup_multiplier  # a true division, as the trunk's (spec 9.8)
        return self.tp.gather_vocab(self.unembed(z))[:, : self.config.unpadded_vocab_size]

    def uses_fp8_head(self, rows: int) -> bool:
        """Whether `logits` of `rows` rows reads the FP8 copy (after `use_fp8_head`, for the rows where it is
        measured faster: `inkling_kernels.fp8_head.preferred`) rather than the shared bf16 lm_head."""
        return self.fp8_head is not None and fp8_preferred(rows)
