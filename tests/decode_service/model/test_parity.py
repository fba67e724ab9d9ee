"""Correctness ladder step 1: our reference decoder == transformers (fp32, eager) on tiny random configs.

Each HF model is written to disk in the RELEASED layout (raw names, interleaved w13, NVFP4 sidecars) and read
back through our loader, so these tests cover checkpoint handling as well as the math.
"""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import CheckpointFiles, load_decoder_weights
from common.config import parse_model_config
from common.nvfp4 import dequant_nvfp4, pack_nvfp4
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.inkling import InklingDecoder
from tests.reference.hf_tiny import build_hf_model, raw_config
from tests.reference.released_layout import hf_state_to_released, write_released_checkpoint

# Three configs covering: sequences longer than the window and rel_extent, tau != 1, dense and MoE layers,
# several sliding/global patterns, differing head geometry between layer kinds, muP 24 and 16.
CONFIGS = {
    "default": {},
    "alternating": {
        "local_layer_ids": [0, 2, 4],
        "dense_mlp_idx": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 2,
        "sliding_window_size": 8,
        "rel_extent": 12,
        "d_rel": 2,
        "log_scaling_n_floor": 4,
        "logits_mup_width_multiplier": 16.0,
    },
    "wide_heads": {
        "num_hidden_layers": 4,
        "local_layer_ids": [1, 2],
        "dense_mlp_idx": 0,
        "head_dim": 8,
        "swa_head_dim": 32,
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 1,
        "sliding_window_size": 5,
        "rel_extent": 20,
        "num_experts_per_tok": 3,
        "n_shared_experts": 3,
        "n_routed_experts": 6,
        "log_scaling_n_floor": 10,
        "log_scaling_alpha": 0.5,
    },
}
SEQ_LEN = 60  # > every window and rel_extent above


def quantize_routed_experts_(hf_model, raw_tensors: dict, layers: list[int]) -> None:
    """Make the given MoE layers NVFP4: the checkpoint gets packed stacks (+ sidecars) and the HF model gets the
    exactly dequantized weights, so both sides compute with the same values."""
    for layer in layers:
        experts = hf_model.model.language_model.layers[layer].mlp.experts
        prefix = f"model.llm.layers.{layer}.mlp.experts."
        for raw_name, hf_param in (("w13_weight", experts.gate_up_proj), ("w2_weight", experts.down_proj)):
            interleaved = raw_tensors[prefix + raw_name].float()
            packed, scale, scale2 = pack_nvfp4(interleaved)
            raw_tensors[prefix + raw_name] = packed
            raw_tensors[prefix + raw_name + ".scale"] = scale
            raw_tensors[prefix + raw_name + ".scale2"] = scale2
            raw_tensors[prefix + raw_name + ".input_amax"] = torch.tensor([3.0], dtype=torch.bfloat16)
            raw_tensors[prefix + raw_name + ".original_shape"] = torch.tensor(interleaved.shape)
            dequant = dequant_nvfp4(packed, scale, scale2)
            if raw_name == "w13_weight":  # HF holds [gate; up], the checkpoint interleaves them
                dequant = torch.cat([dequant[:, 0::2], dequant[:, 1::2]], dim=1)
            with torch.no_grad():
                hf_param.copy_(dequant)


def build_pair(tmp_path, overrides: dict, nvfp4_layers: tuple[int, ...] = (), seed: int = 0):
    raw = raw_config(overrides)
    hf = build_hf_model(raw, seed=seed)
    tensors = hf_state_to_released(hf.state_dict())
    quantize_routed_experts_(hf, tensors, list(nvfp4_layers))
    write_released_checkpoint(tmp_path, raw, tensors, quantized_layers=nvfp4_layers)
    config = parse_model_config(raw)
    weights, _ = load_decoder_weights(CheckpointFiles(tmp_path), config, dtype=torch.float32, device="cpu")
    return hf, InklingDecoder.from_weights(config.text, weights, torch.float32), config


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 200000, (n,), generator=torch.Generator().manual_seed(seed))


def run_chunks(model: InklingDecoder, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed one sequence in the given chunk sizes; return the logits of every position."""
    state, out, pos = model.new_state(), [], 0
    for n in chunks:
        batch = ForwardBatch(ids[pos : pos + n], [SequenceSlice(pos, n, state.layers)])
        out.append(model.logits(model(batch)))
        pos += n
    assert pos == ids.shape[0]
    return torch.cat(out)


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (ours - ref).abs().max().item()
    bound = 1e-4 * ref.abs().max().item()
    assert diff <= bound, f"max abs diff {diff:.3e} > {bound:.3e}"
    return diff


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.no_grad()
def test_full_forward_matches_transformers(tmp_path, name):
    nvfp4 = (3,) if name == "default" else ()
    hf, ours, _ = build_pair(tmp_path, CONFIGS[name], nvfp4_layers=nvfp4)
    ids = random_ids(SEQ_LEN, seed=1)
    ref = hf(input_ids=ids[None]).logits[0]
    assert_close_logits(run_chunks(ours, ids, [SEQ_LEN]), ref)


@torch.no_grad()
def test_tau_and_window_are_exercised(tmp_path):
    """Guard against a parity test that passes trivially: disabling log-scaling or the window changes logits."""
    hf, ours, _ = build_pair(tmp_path, CONFIGS["default"])
    ids = random_ids(SEQ_LEN, seed=2)
    ref = hf(input_ids=ids[None]).logits[0]
    global_attn = next(layer.attn for layer in ours.layers if layer.attn.log_scaling is not None)
    saved = global_attn.log_scaling
    global_attn.log_scaling = None
    try:
        untau = run_chunks(ours, ids, [SEQ_LEN])
    finally:
        global_attn.log_scaling = saved
    assert (untau - ref).abs().max() > 1e-3 * ref.abs().max()


@pytest.mark.parametrize("chunks", [[1] * 48, [5, 11, 16, 16], [47, 1], [16, 16, 16]])
@torch.no_grad()
def test_chunked_prefill_and_decode_match_full_forward(tmp_path, chunks):
    """Chunked prefill + cached single-token decode over 3x the window == one uncached forward."""
    _, ours, config = build_pair(tmp_path, CONFIGS["default"])
    n = sum(chunks)
    assert n >= 3 * config.text.sliding_window
    ids = random_ids(n, seed=3)
    full = run_chunks(ours, ids, [n])
    torch.testing.assert_close(run_chunks(ours, ids, chunks), full, rtol=0, atol=1e-5 * full.abs().max().item())


@torch.no_grad()
def test_packed_batch_equals_sequences_alone(tmp_path):
    """Sequences of different lengths and start positions in one packed forward == each run alone."""
    _, ours, _ = build_pair(tmp_path, CONFIGS["alternating"])
    a, b, c = random_ids(30, 4), random_ids(7, 5), random_ids(20, 6)
    alone = [run_chunks(ours, a, [20, 10]), run_chunks(ours, b, [7]), run_chunks(ours, c, [20])]

    states = [ours.new_state() for _ in range(3)]
    first = ForwardBatch(
        torch.cat([a[:20], c]), [SequenceSlice(0, 20, states[0].layers), SequenceSlice(0, 20, states[2].layers)]
    )
    step1 = ours.logits(ours(first))
    second = ForwardBatch(
        torch.cat([b, a[20:]]), [SequenceSlice(0, 7, states[1].layers), SequenceSlice(20, 10, states[0].layers)]
    )
    step2 = ours.logits(ours(second))
    tol = dict(rtol=0, atol=1e-5 * alone[0].abs().max().item())
    torch.testing.assert_close(torch.cat([step1[:20], step2[7:]]), alone[0], **tol)
    torch.testing.assert_close(step2[:7], alone[1], **tol)
    torch.testing.assert_close(step1[20:], alone[2], **tol)


@torch.no_grad()
def test_multimodal_rows_are_scattered_after_embed_norm(tmp_path):
    """Rows given in `mm_rows` replace the normed embeddings at their positions, unnormalised (HF inputs_embeds)."""
    hf, ours, _ = build_pair(tmp_path, CONFIGS["default"])
    ids = random_ids(40, seed=7)
    index = torch.tensor([3, 4, 5, 20, 21])
    rows = torch.randn(5, 64, generator=torch.Generator().manual_seed(8)) * 3
    embeds = hf.model.language_model.embed_tokens(ids[None]).clone()
    embeds[0, index] = rows
    ref = hf(inputs_embeds=embeds).logits[0]
    state = ours.new_state()
    batch = ForwardBatch(ids, [SequenceSlice(0, 40, state.layers)], mm_rows=rows, mm_index=index)
    assert_close_logits(ours.logits(ours(batch)), ref)
