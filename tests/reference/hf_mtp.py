"""transformers' Inkling MTP modules (`modeling_layers.MtpModel` / `MtpLayer` around `InklingDecoderLayer`) as the
drafter's oracle, filled from the raw tensors of a RELEASED-layout checkpoint.

The raw -> HF renames are written here independently of `common/checkpoint.py` (spec 6.2, 6.6). `depth_forward`
runs one depth uncached over a whole sequence (row positions 0..n-1, SG's convention). By default it computes
what SG/VL (and our drafter) compute, replacing two of HF's choices (spec 7.6), each behind a flag:
- `backbone_norm`: the token embedding goes through the backbone `embed_norm` (HF's own `InklingNormedEmbedding`)
  before the depth's `enorm`; HF's MtpModel feeds the raw embedding (False);
- `window`: sliding depths get the sliding-window causal mask, as transformers >= 5.25's MtpModel gives them;
  earlier MtpModels masked them full-causal, which `window=False` reproduces whatever the installed version.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

# raw transformer_block-relative name -> HF mtp_block-relative name (dense layers only: every depth is dense)
_BLOCK_RENAMES = {
    "attn.wq_du.weight": "self_attn.q_proj.weight",
    "attn.wk_dv.weight": "self_attn.k_proj.weight",
    "attn.wv_dv.weight": "self_attn.v_proj.weight",
    "attn.wr_du.weight": "self_attn.r_proj.weight",
    "attn.wo_ud.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.k_sconv.weight": "self_attn.k_sconv.conv1d.weight",
    "attn.v_sconv.weight": "self_attn.v_sconv.conv1d.weight",
    "attn.rel_logits_proj.proj": "self_attn.rel_logits_proj.proj",
    "attn_sconv.weight": "attn_sconv.conv1d.weight",
    "mlp_sconv.weight": "mlp_sconv.conv1d.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w2_md.weight": "mlp.down_proj.weight",
    "mlp.global_scale": "mlp.global_scale",
}
_DEPTH_RENAMES = {
    "hidden_norm.weight": "hnorm.weight",
    "embed_norm.weight": "enorm.weight",
    "input_proj.weight": "eh_proj.weight",
}
_MTP_NAME = re.compile(r"^model\.mtp\.layers\.(\d+)\.(.+)$")


def mtp_state_from_raw(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every `model.mtp.*` raw tensor -> HF MtpModel state-dict entries (w13_dn rows split even/odd)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if not name.startswith("model.mtp."):
            continue
        value = value.float()
        if name == "model.mtp.chain_norm.weight":
            out["shared_post_norm.weight"] = value
            continue
        match = _MTP_NAME.match(name)
        if match is None:
            raise KeyError(f"unmapped MTP tensor {name}")
        depth, inner = f"layers.{match.group(1)}.", match.group(2)
        if inner in _DEPTH_RENAMES:
            out[depth + _DEPTH_RENAMES[inner]] = value
        elif inner == "transformer_block.mlp.w13_dn.weight":  # rows g0, u0, g1, u1, ...
            out[depth + "mtp_block.mlp.gate_proj.weight"] = value[0::2]
            out[depth + "mtp_block.mlp.up_proj.weight"] = value[1::2]
        elif inner.startswith("transformer_block.") and inner[len("transformer_block.") :] in _BLOCK_RENAMES:
            out[depth + "mtp_block." + _BLOCK_RENAMES[inner[len("transformer_block.") :]]] = value
        else:
            raise KeyError(f"unmapped MTP tensor {name}")
    return out


@torch.no_grad()
def build_hf_mtp(raw: dict, tensors: dict[str, torch.Tensor]):
    """(HF `InklingForCausalLM`, HF `MtpModel`) in fp32 eager, with the checkpoint's embed, embed_norm, unembed and
    every MTP tensor; the trunk layers stay random (the drafter is given the trunk hidden)."""
    from transformers import InklingForCausalLM, InklingTextConfig
    from transformers.modeling_layers import MtpModel

    mtp_block = raw["mtp_config"]
    config = InklingTextConfig(
        **raw["text_config"],
        num_mtp_layers=mtp_block["num_nextn_predict_layers"],
        chain_hidden_post_norm=mtp_block["chain_hidden_post_norm"],
        mtp_local_layer_ids=mtp_block["local_layer_ids"],
    )
    config._attn_implementation = "eager"
    main = InklingForCausalLM(config).float().eval()
    main.model.embed_tokens.weight.copy_(tensors["model.llm.embed.weight"].float())
    main.model.embed_tokens.embed_norm.weight.copy_(tensors["model.llm.embed_norm.weight"].float())
    main.lm_head.weight.copy_(tensors["model.llm.unembed.weight"].float())
    mtp = MtpModel(main, config.num_mtp_layers).float().eval()
    mtp.config._attn_implementation = "eager"
    result = mtp.load_state_dict(mtp_state_from_raw(tensors), strict=False)
    shared = {"embed_tokens.weight", "embed_tokens.embed_norm.weight", "shared_head.weight"}
    if set(result.missing_keys) - shared or result.unexpected_keys:
        raise KeyError(f"HF MtpModel: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    return main, mtp


@torch.no_grad()
def depth_forward(
    main,
    mtp,
    depth: int,
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    backbone_norm: bool = True,
    window: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth `depth` over one whole sequence: hidden `[n, H]`, token_ids `[n]` -> (output hidden `[n, H]` after the
    shared post-norm when enabled, logits `[n, Vu]`)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    ids = token_ids[None]
    positions = torch.arange(ids.shape[1])[None]
    if backbone_norm:
        embeds = main.model.embed_tokens(ids)  # backbone embed_norm applied
    else:
        embeds = F.embedding(ids, main.model.embed_tokens.weight)  # HF MtpModel: raw embedding
    masks = mtp.create_masks_for_mtp_layer(depth, embeds, None, positions)
    if mtp.config.layer_types[depth] == "hybrid_sliding":
        make_mask = create_sliding_window_causal_mask if window else create_causal_mask
        masks["attention_mask"] = make_mask(
            config=mtp.config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions
        )
    out = mtp.layers[depth](embeds, hidden[None], position_embeddings=None, position_ids=positions, cache=None, **masks)
    if mtp.use_shared_post_norm:
        out = mtp.shared_post_norm(out)
    return out[0], mtp._project_to_logits(out)[0].float()
