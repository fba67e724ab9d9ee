"""The MTP drafter (spec/inkling-text.md 7.1-7.2) == transformers' Inkling MTP modules, fp32, on make-tiny checkpoints.

Reference: transformers' `MtpModel` / `MtpLayer` (modeling_layers.py) around `InklingDecoderLayer`, its weights read
from the same checkpoint files through `tests/reference/hf_mtp.py`. Two of HF's choices differ from the production
implementations (spec 7.6) and the reference replaces them, each shown to matter below: HF's MtpModel feeds the
RAW token embedding to the depth's embed_norm, while SG/VL (and the drafter) apply the backbone `embed_norm` first;
HF's MtpModel before transformers 5.25 masked sliding depths full-causal, while they get the real window (5.25's
MtpModel gives it too; the reference builds either mask itself). Both sides receive the same trunk
hidden (our decoder's, itself checked against HF in test_parity.py), so this tests the drafter alone.

Configs: the make-tiny checkpoint (2 depths: depth 0 sliding, depth 1 global; chain_hidden_post_norm off) and one
with every depth global and chain_hidden_post_norm on. Sequences are longer than the window (16) and rel_extent
(32), and tau starts at position 24.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.checkpoint import CheckpointFiles, load_decoder_weights, load_mtp_weights
from common.config import MtpConfig, load_model_config, parse_model_config
from common.errors import CheckpointError
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter, depth_config
from inkling_kernels.fp8_head import FP8, fp8_logits_reference, quantize_rows_fp8
from inkling_kernels.fp8_head import preferred as fp8_preferred
from tests.reference.hf_mtp import build_hf_mtp, depth_forward
from tools.make_tiny_checkpoint import make_tiny_checkpoint, raw_config

CONFIGS = {
    "make_tiny": ({}, 0),
    "global_chain": ({"mtp_config": {"local_layer_ids": [], "chain_hidden_post_norm": True}}, 3),
}
ROWS = 48  # > window 16 and rel_extent 32; tau != 1 from position 24


class Pair:
    """Our trunk + drafter and HF's reference, built from one make-tiny checkpoint."""

    def __init__(self, directory: Path, overrides: dict, seed: int):
        make_tiny_checkpoint(directory, seed=seed, **overrides)
        files, self.config = CheckpointFiles(directory), load_model_config(directory)
        weights, _ = load_decoder_weights(files, self.config, dtype=torch.float32)
        self.trunk = InklingDecoder.from_weights(self.config.text, weights, torch.float32)
        self.mtp_weights, _ = load_mtp_weights(files, self.config, dtype=torch.float32)
        self.drafter = MTPDrafter.from_weights(self.mtp_weights, self.config.mtp, self.trunk)
        raw = {}
        for path in sorted(directory.glob("*.safetensors")):
            raw |= load_file(str(path))
        self.hf_main, self.hf_mtp = build_hf_mtp(self.config.raw, raw)
        self.ids = torch.randint(0, 200000, (ROWS + 2,), generator=torch.Generator().manual_seed(seed + 1))
        state = self.trunk.new_state()
        with torch.no_grad():
            self.hidden = self.trunk(ForwardBatch(self.ids[:ROWS], [SequenceSlice(0, ROWS, state.layers)]))

    def depth_tokens(self, depth: int) -> torch.Tensor:
        """Row i of depth d is paired with token t_{i+d+1} (spec 7.2)."""
        return self.ids[depth + 1 : depth + 1 + ROWS]

    def reference(self, **flags: bool) -> list[torch.Tensor]:
        """HF logits `[ROWS, Vu]` of every depth, chained from the trunk hidden (`flags`: see `depth_forward`)."""
        hidden, out = self.hidden, []
        for d in range(self.config.mtp.num_layers):
            hidden, logits = depth_forward(self.hf_main, self.hf_mtp, d, hidden, self.depth_tokens(d), **flags)
            out.append(logits)
        return out

    @torch.no_grad()
    def ours(self, chunks: list[int]) -> list[torch.Tensor]:
        """Our logits of every depth, each depth fed the rows in `chunks` against its own caches."""
        state, hidden, out = self.drafter.new_state(), self.hidden, []
        for d in range(self.drafter.num_depths):
            tokens, rows, pos = self.depth_tokens(d), [], 0
            for n in chunks:
                batch = ForwardBatch(tokens[pos : pos + n], [SequenceSlice(pos, n, state.layers)])
                rows.append(self.drafter(d, hidden[pos : pos + n], batch))
                pos += n
            assert pos == ROWS
            hidden = torch.cat(rows)
            out.append(self.drafter.logits(hidden))
        return out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory) -> Pair:
    overrides, seed = CONFIGS[request.param]
    return Pair(tmp_path_factory.mktemp(request.param), overrides, seed)


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, depth: int) -> None:
    diff = (ours - ref).abs().max().item()
    bound = 1e-5 * ref.abs().max().item()
    assert diff <= bound, f"depth {depth}: max abs diff {diff:.3e} > {bound:.3e}"


def test_configs_cover_both_depth_kinds_and_chain_norm(pair):
    mtp = pair.config.mtp
    assert mtp.num_layers == 2
    if mtp.chain_hidden_post_norm:
        assert mtp.sliding_layers == (False, False) and pair.drafter.chain_norm is not None
    else:
        assert mtp.sliding_layers == (True, False) and pair.drafter.chain_norm is None
    assert ROWS > pair.drafter.config.sliding_window and ROWS > pair.config.text.rel_extent


def test_depth_logits_match_transformers(pair):
    """Depth 0 (from the trunk hidden) and depth 1 (chained from depth 0) over the whole sequence."""
    for d, (ours, ref) in enumerate(zip(pair.ours([ROWS]), pair.reference(), strict=True)):
        assert_close_logits(ours, ref, d)


@pytest.mark.parametrize("chunks", [[20, 1, 1, 26], [1] * 8 + [40]])
def test_chunked_depths_match_transformers(pair, chunks):
    """Each depth advancing its own KV and conv caches chunk by chunk == HF's uncached forward."""
    for d, (ours, ref) in enumerate(zip(pair.ours(chunks), pair.reference(), strict=True)):
        assert_close_logits(ours, ref, d)


def test_reference_divergences_matter(pair):
    """The parity test checks the production choices: HF's raw embedding, or (for a sliding depth) a full-causal
    mask (older MtpModels'), gives clearly different depth-0 logits."""
    ours = pair.ours([ROWS])[0]
    variants = [{"backbone_norm": False}]
    if pair.config.mtp.sliding_layers[0]:
        variants.append({"window": False})
    for flags in variants:
        hf = pair.reference(**flags)[0]
        assert (ours - hf).abs().max() > 1e-3 * hf.abs().max(), flags


def test_drafter_shares_the_trunk_tensors(pair):
    for name in ("embed", "embed_norm", "unembed"):
        assert getattr(pair.drafter, name) is getattr(pair.trunk, name)
    assert pair.drafter.layers[0].transformer_block.attn_sconv.weight.dtype == torch.float32


def test_missing_and_unexpected_tensors_are_named(pair):
    for name in ("layers.1.transformer_block.attn.wk_dv.weight", "layers.0.hidden_norm.weight"):
        weights = {k: v for k, v in pair.mtp_weights.items() if k != name}
        with pytest.raises(CheckpointError, match=name):
            MTPDrafter.from_weights(weights, pair.config.mtp, pair.trunk)
    weights = {**pair.mtp_weights, "layers.2.embed_norm.weight": pair.mtp_weights["layers.0.embed_norm.weight"]}
    with pytest.raises(CheckpointError, match=r"unexpected \['layers\.2\.embed_norm\.weight'\]"):
        MTPDrafter.from_weights(weights, pair.config.mtp, pair.trunk)


def test_bad_depth_and_hidden_are_errors(pair):
    batch = ForwardBatch(pair.ids[:4], [SequenceSlice(0, 4, pair.drafter.new_state().layers)])
    with pytest.raises(ValueError, match="depth"):
        pair.drafter(2, pair.hidden[:4], batch)
    with pytest.raises(ValueError, match="hidden"):
        pair.drafter(0, pair.hidden[:3], batch)


def test_log_scaling_is_exercised_in_global_depths(pair):
    """tau (from position 24) changes the global depth's logits, so the parity test covers it."""
    attn = pair.drafter.layers[1].transformer_block.attn
    assert attn.log_scaling is not None
    with_tau = pair.ours([ROWS])[1]
    saved, attn.log_scaling = attn.log_scaling, None
    try:
        without_tau = pair.ours([ROWS])[1]
    finally:
        attn.log_scaling = saved
    assert (with_tau - without_tau).abs().max() > 1e-3 * with_tau.abs().max()


@torch.no_grad()
def test_packed_sequences_equal_each_alone(pair):
    """Two sequences of different lengths and start positions packed into one depth forward == each alone."""
    other_ids = torch.randint(0, 200000, (22,), generator=torch.Generator().manual_seed(99))
    other_state = pair.trunk.new_state()
    other_hidden = pair.trunk(ForwardBatch(other_ids[:20], [SequenceSlice(0, 20, other_state.layers)]))
    alone_a = pair.ours([ROWS])[0]
    b_state = pair.drafter.new_state()
    alone_b = pair.drafter.logits(
        pair.drafter(0, other_hidden, ForwardBatch(other_ids[1:21], [SequenceSlice(0, 20, b_state.layers)]))
    )
    a, b = pair.drafter.new_state(), pair.drafter.new_state()
    tokens_a = pair.depth_tokens(0)
    first = ForwardBatch(
        torch.cat([tokens_a[:30], other_ids[1:21]]),
        [SequenceSlice(0, 30, a.layers), SequenceSlice(0, 20, b.layers)],
    )
    step1 = pair.drafter.logits(pair.drafter(0, torch.cat([pair.hidden[:30], other_hidden]), first))
    second = ForwardBatch(tokens_a[30:], [SequenceSlice(30, ROWS - 30, a.layers)])
    step2 = pair.drafter.logits(pair.drafter(0, pair.hidden[30:], second))
    tol = dict(rtol=0, atol=1e-5 * alone_a.abs().max().item())
    torch.testing.assert_close(torch.cat([step1[:30], step2]), alone_a, **tol)
    torch.testing.assert_close(step1[30:], alone_b, **tol)


def test_depth_config_uses_the_mtp_window():
    """Sliding depths take `mtp_config.local_extent` as window and relative extent; global depths the trunk's."""
    text = parse_model_config(raw_config()).text
    mtp = MtpConfig(num_layers=3, chain_hidden_post_norm=False, sliding_layers=(True, False, True), window=8)
    cfg = depth_config(text, mtp)
    assert cfg.num_layers == 3 and cfg.dense_layers == (True, True, True)
    sliding, global_ = cfg.layer_geometry(0), cfg.layer_geometry(1)
    assert (sliding.window, sliding.rel_extent, sliding.num_kv_heads) == (8, 8, text.swa_num_kv_heads)
    assert (global_.window, global_.rel_extent, global_.num_kv_heads) == (None, text.rel_extent, text.num_kv_heads)


def test_bf16_drafter_keeps_convs_fp32(pair):
    trunk = InklingDecoder.from_weights(pair.config.text, pair.trunk.state_dict(), torch.bfloat16)
    drafter = MTPDrafter.from_weights(pair.mtp_weights, pair.config.mtp, trunk)
    for name, p in drafter.named_parameters():
        assert p.dtype == (torch.float32 if name.endswith("sconv.weight") else torch.bfloat16), name
    batch = ForwardBatch(pair.depth_tokens(0)[:5], [SequenceSlice(0, 5, drafter.new_state().layers)])
    with torch.no_grad():
        logits = drafter.logits(drafter(0, pair.hidden[:5].to(torch.bfloat16), batch))
    assert logits.dtype == torch.float32 and logits.shape == (5, pair.config.text.unpadded_vocab_size)


@torch.no_grad()
def test_fp8_head_logits_are_the_fp8_copys(pair):
    """`head="fp8"`: the draft logits of the rows `inkling_kernels.fp8_head.preferred` takes are the FP8 copy's (its
    reference over the unpadded rows, the muP division first), not the bf16 head's; more rows take the bf16 head;
    the trunk's lm_head is untouched."""
    drafter = MTPDrafter.from_weights(pair.mtp_weights, pair.config.mtp, pair.trunk, head="fp8")
    assert pair.drafter.fp8_head is None and pair.trunk.unembed.weight.dtype == torch.float32
    vocab, mup = pair.config.text.unpadded_vocab_size, pair.config.text.mup_multiplier
    w8, scale = drafter.fp8_head
    assert w8.dtype == FP8 and w8.shape == (vocab, pair.config.text.hidden_size) and scale.shape == (vocab,)
    want_w8, want_scale = quantize_rows_fp8(pair.trunk.unembed.weight[:vocab])
    assert torch.equal(w8.float(), want_w8.float()) and torch.equal(scale, want_scale)
    batch = ForwardBatch(pair.depth_tokens(0)[:6], [SequenceSlice(0, 6, drafter.new_state().layers)])
    hidden = drafter(0, pair.hidden[:6], batch)
    assert fp8_preferred(6)
    logits = drafter.logits(hidden)  # the FP8 copy (inkling_kernels.fp8_head.preferred)
    torch.testing.assert_close(logits, fp8_logits_reference(hidden, w8, scale, divisor=mup), rtol=0, atol=0)
    bf16_head = pair.drafter.logits(hidden)
    assert logits.shape == bf16_head.shape and (logits - bf16_head).abs().max() > 1e-4 * bf16_head.abs().max()
    many = next(m for m in range(1, 1024) if not fp8_preferred(m))  # more rows: the bf16 head
    rows = hidden.repeat(-(-many // 6), 1)[:many]
    assert torch.equal(drafter.logits(rows), pair.drafter.logits(rows))
    with pytest.raises(ValueError, match="head"):
        MTPDrafter.from_weights(pair.mtp_weights, pair.config.mtp, pair.trunk, head="int4")
