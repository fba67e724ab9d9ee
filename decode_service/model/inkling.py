"""The Inkling text decoder (spec/inkling-text.md section 2) over explicit packed batches."""

from __future__ import annotations

import torch
from torch import nn

from common.config import TextConfig
from decode_service.model.batch import ForwardBatch
from decode_service.model.layers import DecoderLayer, RMSNorm
from decode_service.model.state import SequenceState


class InklingDecoder(nn.Module):
    """embed -> embed_norm (-> multimodal rows scattered in) -> layers -> final norm.

    `forward` returns the final-normed hidden `y` (what the MTP drafter also consumes); `logits` applies the muP
    division and the unembedding and drops the padded vocabulary columns.
    """

    def __init__(self, config: TextConfig, nvfp4_layers: frozenset[int] = frozenset()):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i, nvfp4=i in nvfp4_layers) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.unembed = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def from_weights(
        cls,
        config: TextConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> InklingDecoder:
        """Build on the meta device and adopt the loader's tensors (NVFP4 layers are those with packed experts)."""
        nvfp4 = frozenset(
            i
            for i in range(config.num_layers)
            if weights.get(f"layers.{i}.mlp.experts.w13_weight", torch.empty(0)).dtype == torch.uint8
        )
        with torch.device("meta"):
            model = cls(config, nvfp4)
        weights = stack_attention_projections(weights, config.num_layers)
        keep = ("sconv.weight", "mlp.gate.bias", "mlp.gate.global_scale")  # fp32 by contract (spec 4.2, 5.2)
        weights = {
            name: t.to(
                device=device,
                dtype=dtype if t.is_floating_point() and t.element_size() > 1 and not name.endswith(keep) else t.dtype,
            )
            for name, t in weights.items()
        }
        for name, t in weights.items():
            if name.endswith("shared_w2_weight"):  # [S, H, I] viewed from [H, S, I] storage: K-concatenated rows
                weights[name] = t.permute(1, 0, 2).contiguous().permute(1, 0, 2)
        model.load_state_dict(weights, strict=True, assign=True)
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_state(self) -> SequenceState:
        return SequenceState.fresh(self.config, device=self.embed.weight.device, conv_dtype=self.dtype)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final-normed hidden `[T, H]`; every sequence's caches advance by its new tokens."""
        h = self.embed_norm(self.embed(batch.token_ids))  # [T, H]
        if batch.mm_rows is not None:
            h = h.index_copy(0, batch.mm_index, batch.mm_rows.to(h.dtype))  # encoder rows are not re-normed
        for layer in self.layers:
            h = layer(h, batch)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, H]` final-normed rows -> fp32 logits `[N, unpadded_vocab]`."""
        z = hidden / self.config.mup_multiplier  # a true division (spec 9.8)
        return self.unembed(z)[:, : self.config.unpadded_vocab_size].float()


def stack_attention_projections(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's four attention input projections per layer -> the model's stacked `attn.qkvr` rows
    (weights already named like the model's state dict pass through)."""
    weights = dict(weights)
    for i in range(num_layers):
        names = [f"layers.{i}.attn.{p}.weight" for p in ("wq_du", "wk_dv", "wv_dv", "wr_du")]
        if names[0] in weights:
            weights[f"layers.{i}.attn.qkvr.weight"] = torch.cat([weights.pop(n) for n in names])
    return weights
