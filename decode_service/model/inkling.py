"""The Inkling text decoder (spec/inkling-text.md section 2) over explicit packed batches."""

from __future__ import annotations

import torch
from torch import nn

from common.config import TextConfig
from decode_service.model.backend import AttentionBackend, PreparedBatch
from decode_service.model.batch import ForwardBatch
from decode_service.model.collectives import SINGLE, TPGroup
from decode_service.model.fast_path import resolve_ops
from decode_service.model.layers import DecoderLayer, RMSNorm
from decode_service.model.ops import Ops
from decode_service.model.packed import PackedBackend, kernel_head_dim
from decode_service.model.paged import PagedBackend
from decode_service.model.state import SequenceState


class InklingDecoder(nn.Module):
    """embed -> embed_norm (-> multimodal rows scattered in) -> layers -> final norm.

    `forward` returns the final-normed hidden `y` (what the MTP drafter also consumes); `logits` applies the muP
    division and the unembedding and drops the padded vocabulary columns.

    The op bundle and the attention backends are fixed here, at build: `ops` is an `Ops` or a name of
    `fast_path.OPS` ("auto" resolves against `device`, where the weights will live; a model moved to another
    device keeps its ops, `with_ops` rebuilds it). `packed` runs `ForwardBatch`es of `SequenceSlice`s; `paged`
    runs `PagedDecode` batches and exists only when the ops have kernels for every op of such a step.

    One rank of a tensor-parallel replica is this model built with the rank's local sizes as `config` and its
    `tp` group (`parallel.build_rank_decoder`): the embedding and the lm_head are vocab-parallel through it.
    """

    def __init__(
        self,
        config: TextConfig,
        nvfp4_layers: frozenset[int] = frozenset(),
        ops: Ops | str = "auto",
        device: torch.device | str = "cpu",
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        ops = resolve_ops(ops, device)
        self.config, self.ops, self.nvfp4_layers, self.tp = config, ops, frozenset(nvfp4_layers), tp
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, ops, nvfp4=i in nvfp4_layers, tp=tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.unembed = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed: AttentionBackend = PackedBackend(kernels=ops.attention_kernels)
        self.paged: AttentionBackend | None = PagedBackend() if _paged_kernels(config, ops) else None

    @classmethod
    def from_weights(
        cls,
        config: TextConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: Ops | str = "auto",
        tp: TPGroup = SINGLE,
    ) -> InklingDecoder:
        """Build on the meta device and adopt the loader's tensors: NVFP4 experts (`NVFP4Experts`) in the layers
        whose routed stacks are packed, `Bf16Experts` elsewhere; `ops` as for the constructor."""
        nvfp4 = frozenset(
            i
            for i in range(config.num_layers)
            if weights.get(f"layers.{i}.mlp.experts.w13_weight", torch.empty(0)).dtype == torch.uint8
        )
        ops = resolve_ops(ops, device)
        with torch.device("meta"):
            model = cls(config, nvfp4, ops, tp=tp)
        weights = stack_attention_projections(weights, config.num_layers)
        keep = ("sconv.weight", "mlp.gate.bias", "mlp.gate.global_scale")  # fp32 by contract (spec 4.2, 5.2)
        weights = {
            name: t.to(
                device=device,
                dtype=dtype if t.is_floating_point() and t.element_size() > 1 and not name.endswith(keep) else t.dtype,
            )
            for name, t in weights.items()
        }
        model.adopt(weights)
        return model.eval()

    def adopt(self, weights: dict[str, torch.Tensor]) -> None:
        """Take `weights` (named like the state dict, on their device and dtype) as this model's tensors; the
        shared experts' down weights are re-laid in `[H, S, I]` storage unless they already are."""
        weights = dict(weights)
        for name, t in weights.items():
            if name.endswith("shared_w2_weight") and not t.permute(1, 0, 2).is_contiguous():
                weights[name] = t.permute(1, 0, 2).contiguous().permute(1, 0, 2)  # [S, H, I], K-concatenated rows
        self.load_state_dict(weights, strict=True, assign=True)

    def with_ops(self, ops: Ops | str) -> InklingDecoder:
        """The same weight tensors (shared, not copied) in a decoder built with `ops`, resolved against the device
        the weights are on now."""
        with torch.device("meta"):
            model = type(self)(self.config, self.nvfp4_layers, resolve_ops(ops, self.embed.weight.device), tp=self.tp)
        model.adopt({name: t.detach() for name, t in self.state_dict(keep_vars=True).items()})
        return model.train(self.training)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_state(self) -> SequenceState:
        return SequenceState.fresh(self.config, device=self.embed.weight.device, conv_dtype=self.dtype)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final-normed hidden `[T, H]`; every sequence's caches advance by its new tokens."""
        h = self.embed_norm(self.tp.embed(self.embed, batch.token_ids))  # [T, H]
        if batch.mm_rows is not None:
            h = h.index_copy(0, batch.mm_index, batch.mm_rows.to(h.dtype))  # encoder rows are not re-normed
        step = self.prepare(batch)
        for layer in self.layers:
            h = layer(h, step)
        return self.norm(h)

    def prepare(self, batch: ForwardBatch) -> PreparedBatch:
        """The batch's per-step attention metadata from the backend for its kind (packed or paged)."""
        return (self.packed if batch.decode is None else self._paged()).prepare(batch)

    def _paged(self) -> AttentionBackend:
        if self.paged is None:
            raise ValueError(
                f"batch.decode: this model was built with {self.ops.name!r} ops, which have no paged decode step "
                "for its shapes (see fast_path.supports_batched_decode)"
            )
        return self.paged

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, H]` final-normed rows -> fp32 logits `[N, unpadded_vocab]`."""
        config = self.config
        return self.ops.logits(hidden, self.unembed.weight, config.mup_multiplier, self.tp, config.unpadded_vocab_size)

    def argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, H]` final-normed rows -> int64 `[N]`, `logits(hidden).argmax(-1)` without materialising the logits."""
        config = self.config
        return self.ops.argmax_logits(
            hidden, self.unembed.weight, config.mup_multiplier, self.tp, config.unpadded_vocab_size
        )


def stack_attention_projections(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's four attention input projections per layer -> the model's stacked `attn.qkvr` rows
    (weights already named like the model's state dict pass through)."""
    weights = dict(weights)
    for i in range(num_layers):
        names = [f"layers.{i}.attn.{p}.weight" for p in ("wq_du", "wk_dv", "wv_dv", "wr_du")]
        if names[0] in weights:
            weights[f"layers.{i}.attn.qkvr.weight"] = torch.cat([weights.pop(n) for n in names])
    return weights


def _paged_kernels(config: TextConfig, ops: Ops) -> bool:
    """Whether every op of a `PagedDecode` step has its kernel in `ops` for these shapes: attention for every
    layer's head_dim, the routed experts of every MoE layer."""
    if not ops.attention_kernels:
        return False
    if not all(kernel_head_dim(config.layer_geometry(i).head_dim) for i in range(config.num_layers)):
        return False
    moe = not all(config.dense_layers)
    return not moe or ops.moe_kernels(config.hidden_size, config.moe_intermediate_size)
