"""The decoder's fast path (Triton MoE + decode attention) against its reference torch path.

On CPU the kernels run in Triton's interpreter at tiny shapes; the GPU tests run the tiny released-layout
checkpoint in bf16 through the Engine, fast path against reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.config import parse_model_config
from common.nvfp4 import dequant_nvfp4, pack_nvfp4
from decode_service.model import packed
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.collectives import SINGLE
from decode_service.model.fast_path import FAST, resolve_ops, supports_batched_decode
from decode_service.model.inkling import InklingDecoder
from decode_service.model.layers import Bf16Experts, NVFP4Experts, SharedExperts, ShortConv
from decode_service.model.ops import REFERENCE, bf16_experts_reference, nvfp4_experts_reference
from inkling_kernels import skinny_gemm
from inkling_kernels.moe import unshuffle_nvfp4
from inkling_kernels.skinny_gemm import MAX_ROWS

# Window 8 and rel_extent 12 below the decoded lengths, tau active (n_floor 6), d_rel 4 (zero-padded to 16 for the
# kernel), bf16 experts in layer 1 and NVFP4 experts in layers 2-3, layer 3 global.
TINY = {
    "model_type": "inkling",
    "vocab_size": 96,
    "unpadded_vocab_size": 90,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 1,
    "swa_head_dim": 16,
    "sliding_window_size": 8,
    "d_rel": 4,
    "rel_extent": 12,
    "log_scaling_n_floor": 6,
    "local_layer_ids": [0, 1, 2],
    "dense_mlp_idx": 1,
    "dense_intermediate_size": 48,
    "intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "route_scale": 2.0,
    "logits_mup_width_multiplier": 4.0,
    "eos_token_id": 3,
}
NVFP4_LAYERS = frozenset({2, 3})


def tiny_model(seed: int = 0, **overrides) -> InklingDecoder:
    config = parse_model_config({**TINY, **overrides}).text
    gen = torch.Generator().manual_seed(seed)
    model = InklingDecoder(config, NVFP4_LAYERS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "sconv" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif not name.endswith(("global_scale", "gate.bias")):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for layer in NVFP4_LAYERS:
            experts = model.layers[layer].mlp.experts
            for stack in ("w13_weight", "w2_weight"):
                packed = getattr(experts, stack)
                w = torch.randn(*packed.shape[:-1], 2 * packed.shape[-1], generator=gen) / math.sqrt(
                    2 * packed.shape[-1]
                )
                for suffix, value in zip(("", "_scale", "_scale2"), pack_nvfp4(w), strict=True):
                    getattr(experts, stack + suffix).copy_(value)
    return model.eval()


def prefill(model: InklingDecoder, prompts: list[list[int]]) -> tuple[list, list[int]]:
    """Each prompt alone on the current path -> (states, greedy next token of each)."""
    states, dev, last = [model.new_state() for _ in prompts], model.embed.weight.device, []
    with torch.inference_mode():
        for p, state in zip(prompts, states, strict=True):
            hidden = model(ForwardBatch(torch.tensor(p, device=dev), [SequenceSlice(0, len(p), state.layers)]))
            last.append(int(model.logits(hidden[-1:]).argmax()))
    return states, last


def run(
    model: InklingDecoder, prompts: list[list[int]], steps: int, ops: str, forced: list[list[int]] | None = None
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill each prompt alone, then decode all sequences together, feeding the greedy tokens (or `forced`), on
    `model`'s weights built with `ops`; -> the logits of every decode step and the tokens fed at each step."""
    model = model.with_ops(ops)
    dev, logits, fed = model.embed.weight.device, [], []
    with torch.inference_mode():
        states, last = prefill(model, prompts)
        lengths = [len(p) for p in prompts]
        for i in range(steps):
            last = forced[i] if forced is not None else last
            fed.append(last)
            seqs = [SequenceSlice(n, 1, s.layers) for n, s in zip(lengths, states, strict=True)]
            step = model.logits(model(ForwardBatch(torch.tensor(last, device=dev), seqs)))  # [B, V]
            logits.append(step)
            last = step.argmax(-1).tolist()
            lengths = [n + 1 for n in lengths]
    return logits, fed


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_ops_are_chosen_at_build():
    assert resolve_ops("auto", "cpu") is REFERENCE and resolve_ops("fast", "cpu") is FAST
    assert resolve_ops("reference", "cuda") is REFERENCE
    with pytest.raises(ValueError, match="ops 'turbo'"):
        resolve_ops("turbo", "cpu")
    model = tiny_model()
    assert model.ops is REFERENCE and not supports_batched_decode(model)  # CPU, "auto"
    fast = model.with_ops("fast")
    assert fast.ops is FAST and supports_batched_decode(fast)
    assert all(layer.attn_norm.ops is FAST for layer in fast.layers)
    assert fast.embed.weight.data_ptr() == model.embed.weight.data_ptr()  # the same tensors, not a copy


def test_fast_ops_keep_nvfp4_experts_in_the_kernels_layout():
    """Re-laid once when adopted (uint8 block scales), the same dequantised values; a reference model built from
    the fast one reads that layout as it is. I = 64: K tiles of 64, the narrowest the layout takes."""
    model = tiny_model(intermediate_size=64)
    fast = model.with_ops("fast")
    for layer in NVFP4_LAYERS:
        mine, theirs = model.layers[layer].mlp.experts, fast.layers[layer].mlp.experts
        assert theirs.shuffled and not mine.shuffled
        for stack in ("w13_weight", "w2_weight"):
            assert getattr(theirs, f"{stack}_scale").dtype == torch.uint8
            back = unshuffle_nvfp4(getattr(theirs, stack), getattr(theirs, f"{stack}_scale"))
            scale2 = getattr(mine, f"{stack}_scale2")
            want = dequant_nvfp4(getattr(mine, stack), getattr(mine, f"{stack}_scale"), scale2)
            assert torch.equal(dequant_nvfp4(*back, scale2), want)
    again = fast.with_ops("reference")
    assert again.layers[2].mlp.experts.w13_weight.data_ptr() == fast.layers[2].mlp.experts.w13_weight.data_ptr()
    x = torch.randn(3, model.config.hidden_size)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    wts = torch.rand(3, 2)
    assert torch.equal(again.layers[2].mlp.experts(x, ids, wts), model.layers[2].mlp.experts(x, ids, wts))


def test_conv_weights_are_adopted_tap_major():
    """A checkpoint's `[C, 1, K]` conv weights are re-laid when adopted: each tap's weights one contiguous channel
    vector (as the conv kernels load them), the same values; a model built from that one shares them."""
    model = tiny_model()
    with torch.device("meta"):
        adopted = InklingDecoder(model.config, NVFP4_LAYERS)
    adopted.adopt({name: t.detach().contiguous() for name, t in model.state_dict().items()})  # checkpoint layout
    fast = adopted.with_ops("fast")
    convs = [(name, m) for name, m in adopted.named_modules() if isinstance(m, ShortConv)]
    assert len(convs) == 4 * model.config.num_layers
    for name, conv in convs:
        c, _, k = conv.weight.shape
        assert conv.weight.stride() == (1, c, c) and conv.weight[:, 0, :].stride() == (1, c)
        assert torch.equal(conv.weight, model.get_submodule(name).weight)
        assert fast.get_submodule(name).weight.data_ptr() == conv.weight.data_ptr()


def test_fast_ops_keep_the_checkpoint_layout_below_the_shuffled_k_tiles():
    """I = 32 (the tiny checkpoint's): the down kernel's K tile shrinks to 32, which the shuffled layout does not
    take (`SHUFFLED_MIN_BLOCK_K`), so the fast model keeps the e4m3 stacks it adopted and runs the canonical kernels."""
    model = tiny_model()
    fast = model.with_ops("fast")
    for layer in NVFP4_LAYERS:
        experts = fast.layers[layer].mlp.experts
        assert not experts.shuffled and experts.moe is not nvfp4_experts_reference
        assert experts.w13_weight_scale.dtype == experts.w2_weight_scale.dtype == torch.float8_e4m3fn
        assert experts.w13_weight.data_ptr() == model.layers[layer].mlp.experts.w13_weight.data_ptr()


def test_shapes_the_kernels_do_not_take_keep_the_reference_at_build():
    """head_dim 24 (not a power of two): no paged backend; I = 40 (no tile of >= 16 divides it): reference experts."""
    config = parse_model_config({**TINY, "head_dim": 24, "swa_head_dim": 24, "intermediate_size": 40}).text
    built = InklingDecoder(config, NVFP4_LAYERS, ops="fast")
    assert built.paged is None and not supports_batched_decode(built)
    assert built.layers[1].mlp.experts.moe is bf16_experts_reference
    assert built.layers[2].mlp.experts.moe is nvfp4_experts_reference
    assert tiny_model().with_ops("fast").layers[1].mlp.experts.moe is not bf16_experts_reference


def test_paged_decode_needs_the_paged_backend():
    model = tiny_model()
    batch = ForwardBatch(torch.zeros(1, dtype=torch.long), [], decode=object())  # rejected before it is read
    with pytest.raises(ValueError, match="batch.decode"):
        model(batch)


def test_loader_picks_the_experts_per_layer():
    model = tiny_model()
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    built = InklingDecoder.from_weights(model.config, weights, torch.float32, ops="fast")
    kinds = [type(getattr(layer.mlp, "experts", None)) for layer in built.layers]
    assert kinds == [type(None), Bf16Experts, NVFP4Experts, NVFP4Experts]
    assert built.ops is FAST and built.layers[2].mlp.experts.w13_weight.dtype == torch.uint8


def test_packed_attention_picks_its_kernel_per_batch(monkeypatch):
    """With kernels: the decode kernel when every sequence brings one token (and, on a log-scaled layer, every
    cache starts at position 0), else the prefill kernel per sequence; without kernels, `Attention.attend`."""
    model = tiny_model()
    calls = []
    monkeypatch.setattr(packed, "decode_attention", lambda attn, q, *_: calls.append("decode") or torch.zeros_like(q))
    monkeypatch.setattr(packed, "prefill_attention", lambda attn, q, *_: calls.append("prefill") or torch.zeros_like(q))

    def attend(kernels: bool, layer: int, seqs: list[tuple[int, int]]) -> str:
        attn, calls[:] = model.layers[layer].attn, []
        slices = [SequenceSlice(start, n, model.new_state().layers) for start, n in seqs]
        t = sum(n for _, n in seqs)
        step = packed.PackedBackend(kernels).prepare(ForwardBatch(torch.zeros(t, dtype=torch.long), slices))
        q, r, k0, v0 = attn.project(torch.randn(t, 64))
        step.attention(attn, q, r, k0, v0)
        return ",".join(calls) or "torch"

    assert attend(True, 0, [(0, 1), (0, 1)]) == "decode"
    assert attend(True, 0, [(0, 3)]) == "prefill"
    assert attend(True, 0, [(0, 2), (0, 1)]) == "prefill,prefill"
    assert attend(True, 3, [(5, 1)]) == "prefill"  # global layer, tau: a cache from position 5 needs positions
    assert attend(True, 3, [(0, 1)]) == "decode"
    assert attend(False, 0, [(0, 1), (0, 1)]) == "torch"


def test_linearised_shared_experts_match_the_per_expert_sum(cpu_interpreter):
    """Two shared experts, down weights stored K-concatenated as `SharedExperts` keeps them: one GEMM each way."""
    config = parse_model_config({**TINY, "n_shared_experts": 2}).text
    shared = SharedExperts(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        shared.shared_w13_weight.copy_(torch.randn(shared.shared_w13_weight.shape, generator=gen) / 8)
        shared.shared_w2_weight.copy_(torch.randn(shared.shared_w2_weight.shape, generator=gen) / 6)
    assert shared.shared_w2_weight.permute(1, 0, 2).is_contiguous()
    x, gammas = torch.randn(5, 64, generator=gen), torch.rand(5, 2, generator=gen)
    w13, w2 = shared.shared_w13_weight, shared.shared_w2_weight
    ref = REFERENCE.shared_experts(x, gammas, w13, w2)
    assert rel_err(FAST.shared_experts(x, gammas, w13, w2), ref) < 1e-6
    assert torch.equal(shared(x, gammas), ref)
    with pytest.raises(ValueError, match="shared_w2_weight"):
        FAST.shared_experts(x, gammas, w13, w2.contiguous())  # [S, H, I] storage: not the linearised layout


@pytest.mark.parametrize("rows", [1, 3])
def test_dense_ops_take_the_skinny_kernel_where_it_beats_cublas(cpu_interpreter, monkeypatch, rows):
    """Where `skinny_gemm.preferred` says so (one row here: the tiny weights are narrow) the linears, the SwiGLU
    (gammas fused) and the lm_head run `inkling_kernels.skinny_gemm`; elsewhere the reference ops (cuBLAS on a GPU), bit
    for bit, but the SwiGLU: cuBLAS, then `inkling_kernels.swiglu` (its exp may differ from torch's in the last bit)."""
    calls = []
    for name in ("skinny_linear", "skinny_swiglu"):
        kernel = getattr(skinny_gemm, name)
        monkeypatch.setattr(skinny_gemm, name, lambda *a, kernel=kernel, **kw: calls.append(1) or kernel(*a, **kw))
    gen = torch.Generator().manual_seed(rows)
    x, w13, w2 = torch.randn(rows, 64, generator=gen), torch.randn(96, 64, generator=gen) / 8, torch.randn(40, 48)
    gammas, scale = torch.rand(rows, 2, generator=gen), torch.tensor([1.5])
    pairs = [
        (FAST.linear(x, w13), REFERENCE.linear(x, w13)),
        (FAST.swiglu(x, w13, 24, gammas), REFERENCE.swiglu(x, w13, 24, gammas)),
        (FAST.linear(x[:, :48], w2, scale), REFERENCE.linear(x[:, :48], w2, scale)),
        (FAST.logits(x, w13, 16.0, SINGLE, 90), REFERENCE.logits(x, w13, 16.0, SINGLE, 90)),
    ]
    kernel = skinny_gemm.preferred(rows, 96)
    assert kernel == (rows == 1)
    for n, (fast, ref) in enumerate(pairs):
        assert fast.dtype == ref.dtype and fast.shape == ref.shape
        assert rel_err(fast, ref) < 1e-6 if kernel or n == 1 else torch.equal(fast, ref)
    assert len(calls) == (len(pairs) if kernel else 0)
    assert rel_err(FAST.swiglu(x, w13, 24), REFERENCE.swiglu(x, w13, 24)) < 1e-6


def test_bf16_logits_of_several_rows_are_the_reference_cast(cpu_interpreter):
    """Above one row the lm_head is the reference's product; its unpadded columns (a strided view) are cast by
    `float_rows`: the reference's fp32 logits bit for bit, contiguous."""
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(3, 64, generator=gen).bfloat16(), (torch.randn(96, 64, generator=gen) / 8).bfloat16()
    fast = FAST.logits(x, weight, 16.0, SINGLE, 90)
    assert fast.is_contiguous() and torch.equal(fast, REFERENCE.logits(x, weight, 16.0, SINGLE, 90))


def test_skinny_kernel_crossover():
    """The measured crossover: one row at every width, cuBLAS from two rows on (the lm_head too)."""
    assert skinny_gemm.preferred(1, 4096) and skinny_gemm.preferred(1, 200058)
    assert not skinny_gemm.preferred(2, 200058) and not skinny_gemm.preferred(8, 32768)
    assert not skinny_gemm.preferred(MAX_ROWS + 1, 200058)


@pytest.mark.parametrize("width", [32, 64])  # routed experts in the checkpoint's layout / in the shuffled one
def test_fast_path_matches_reference_in_the_interpreter(cpu_interpreter, width):
    model = tiny_model(intermediate_size=width)
    prompts = [[5, 9, 11, 20, 7, 33, 2, 41, 8, 17], [12, 30, 4]]  # past window 8 / rel_extent 12 / n_floor 6
    ref, _ = run(model, prompts, steps=4, ops="reference")
    fast, _ = run(model, prompts, steps=4, ops="fast")
    for r, f in zip(ref, fast, strict=True):
        assert rel_err(f, r) < 1e-4
        assert torch.equal(f.argmax(-1), r.argmax(-1))


def test_paired_expert_blocks_match_reference_in_the_interpreter(cpu_interpreter):
    """A batch of 1000 tokens (2000 (token, slot) pairs, ~250 per expert) on the shuffled layout takes the paired
    row blocks over the model's shrunk tiles; its routed experts equal the reference's reading of the same tensors."""
    from decode_service.model.fast_path import _moe_config

    model = tiny_model(intermediate_size=64)
    model = InklingDecoder.from_weights(model.config, model.state_dict(), torch.float32, "cpu", ops="reference")
    fast = model.with_ops("fast")
    t, h = 1000, model.config.hidden_size
    assert _moe_config(t * model.config.num_experts_per_tok, h, 64, True, True, True).pair_blocks
    layer = min(NVFP4_LAYERS)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ids, weights, _ = model.layers[layer].mlp.gate(x)
        ref = model.layers[layer].mlp.experts(x, ids, weights)
        out = fast.layers[layer].mlp.experts(x, ids, weights)
    assert fast.layers[layer].mlp.experts.w13_weight_scale.dtype == torch.uint8  # the shuffled layout
    assert rel_err(out, ref) < 1e-5


def test_chunked_prefill_matches_reference_in_the_interpreter(cpu_interpreter):
    """Prefill in chunks of 6 (later chunks start past the window of 8, the bias extent of 12 and tau's floor of
    6): the prefill attention kernel against `Attention.attend`."""
    model = tiny_model()
    ids = torch.randint(4, 90, (20,), generator=torch.Generator().manual_seed(2))
    logits = {}
    for ops in ("reference", "fast"):
        built, rows = model.with_ops(ops), []
        state = built.new_state()
        with torch.inference_mode():
            for start in range(0, 20, 6):
                chunk = ids[start : start + 6]
                rows.append(built.logits(built(ForwardBatch(chunk, [SequenceSlice(start, len(chunk), state.layers)]))))
        logits[ops] = torch.cat(rows)
    assert rel_err(logits["fast"], logits["reference"]) < 1e-5


def test_packed_prefill_chunks_match_each_sequence_alone_in_the_interpreter(cpu_interpreter):
    """One packed step of three sequences (a later chunk past the window and tau's floor, a first chunk, a decode
    token): the batched convs (one launch over all rows) and the per-sequence attention on the fast path against
    each sequence stepped alone on the reference path."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(4)
    history = {"reference": [], "fast": []}
    spans = [(9, 7), (0, 5), (13, 1)]  # (tokens already cached, new tokens)
    ids = [torch.randint(4, 90, (start + n,), generator=gen) for start, n in spans]
    for ops in ("reference", "fast"):
        built = model.with_ops(ops)
        states = [built.new_state() for _ in spans]
        with torch.inference_mode():
            for (start, _), seq_ids, state in zip(spans, ids, states, strict=True):
                if start:
                    built(ForwardBatch(seq_ids[:start], [SequenceSlice(0, start, state.layers)]))
            if ops == "fast":
                new = torch.cat([seq_ids[start:] for (start, _), seq_ids in zip(spans, ids, strict=True)])
                slices = [SequenceSlice(start, n, s.layers) for (start, n), s in zip(spans, states, strict=True)]
                history[ops] = built.logits(built(ForwardBatch(new, slices)))
            else:
                history[ops] = torch.cat([
                    built.logits(built(ForwardBatch(seq_ids[start:], [SequenceSlice(start, n, state.layers)])))
                    for (start, n), seq_ids, state in zip(spans, ids, states, strict=True)
                ])  # fmt: skip
    assert rel_err(history["fast"], history["reference"]) < 1e-5


def tiny_checkpoint(tmp_path, dtype: torch.dtype):
    from common.checkpoint import CheckpointFiles, load_decoder_weights
    from common.config import load_model_config
    from tools.make_tiny_checkpoint import make_tiny_checkpoint

    directory = make_tiny_checkpoint(tmp_path / "tiny", nvfp4=True, seed=0)
    config = load_model_config(directory)
    weights, _ = load_decoder_weights(CheckpointFiles(directory), config, dtype=dtype, device="cuda")
    prompts = [
        torch.randint(10, 20000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 40, 70)
    ]
    return InklingDecoder.from_weights(config.text, weights, dtype, "cuda"), config, prompts


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shuffled_experts_match_reference_on_the_gpu(cuda_device, dtype):
    """I = 64, where the fast model re-lays its NVFP4 stacks (the tiny checkpoint's I = 32 keeps them as loaded):
    its routed experts against the reference's reading of the same tensors, one (token, slot) pair per row block,
    pairs sorted by expert, and sorted blocks in pairs (T=1000); bounds as for the tiny checkpoint's modules (bf16)
    and its fp32 run (TF32)."""
    model = tiny_model(intermediate_size=64)
    model = InklingDecoder.from_weights(model.config, model.state_dict(), dtype, "cuda", ops="reference")
    built = {ops: model.with_ops(ops) for ops in ("reference", "fast")}
    gen = torch.Generator().manual_seed(1)
    errors = {}
    with torch.inference_mode():
        for layer in sorted(NVFP4_LAYERS):
            assert built["fast"].layers[layer].mlp.experts.w13_weight_scale.dtype == torch.uint8
            for t in (2, 200, 1000):  # 1000: paired row blocks
                x = torch.randn(t, model.config.hidden_size, generator=gen).to("cuda", dtype)
                ids, weights, _ = model.layers[layer].mlp.gate(x)
                outs = [m.layers[layer].mlp.experts(x, ids, weights) for m in built.values()]
                errors[f"moe{layer}/T{t}"] = rel_err(outs[1], outs[0])
    print(f"shuffled experts {dtype}:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < (2e-2 if dtype == torch.bfloat16 else 1e-2)


@pytest.mark.gpu
def test_tiny_checkpoint_modules_match_reference_in_bf16(cuda_device, tmp_path):
    """Each attention and routed-expert module of the bf16 checkpoint on identical inputs, fast vs reference.

    Whole-model bf16 logits are no test here: on random weights a 2^-8 perturbation of the reference path
    alone already moves the decode logits by ~60-120% (router top-k flips, measured on an H200), so the two
    bf16 paths are compared module by module; the fp32 test below compares whole runs."""
    model, _, prompts = tiny_checkpoint(tmp_path, torch.bfloat16)
    built = {ops: model.with_ops(ops) for ops in ("reference", "fast")}
    gen = torch.Generator().manual_seed(0)
    states, _ = prefill(built["reference"], prompts)
    errors = {}
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            u = torch.randn(len(prompts), model.config.hidden_size, generator=gen).to("cuda", torch.bfloat16)
            outs = []
            for m in built.values():
                seqs = [SequenceSlice(len(p), 1, s.clone().layers) for p, s in zip(prompts, states, strict=True)]
                step = m.packed.prepare(ForwardBatch(torch.zeros(len(seqs), dtype=torch.long, device="cuda"), seqs))
                outs.append(m.layers[i].attn(u, step))
            errors[f"attn{i}"] = rel_err(outs[1], outs[0])
            if not hasattr(layer.mlp, "experts"):
                continue
            for t in (2, 200):  # one (token, slot) pair per row block / pairs sorted by expert
                x = torch.randn(t, model.config.hidden_size, generator=gen).to("cuda", torch.bfloat16)
                ids, weights, _ = layer.mlp.gate(x)
                outs = [m.layers[i].mlp.experts(x, ids, weights) for m in built.values()]
                errors[f"moe{i}/T{t}"] = rel_err(outs[1], outs[0])
    print("tiny checkpoint bf16, per module:", {k: f"{v:.1e}" for k, v in errors.items()})
    ref, fed = run(model, prompts, steps=64, ops="reference")
    fast, _ = run(model, prompts, steps=64, ops="fast", forced=fed)
    steps = sorted(rel_err(f, r) for f, r in zip(fast, ref, strict=True))
    same = torch.cat([f.argmax(-1) == r.argmax(-1) for f, r in zip(fast, ref, strict=True)]).float().mean().item()
    print(
        f"tiny checkpoint bf16, teacher-forced 64 steps: logits rel err median {steps[32]:.1e} max {steps[-1]:.1e}, "
        f"same greedy token {same:.1%}"
    )
    assert max(errors.values()) < 2e-2  # both paths round to bf16, at different points


@pytest.mark.gpu
def test_tiny_checkpoint_fp32_fast_matches_reference(cuda_device, tmp_path):
    """fp32 on CUDA, 64 decode steps of 4 sequences with the reference's greedy tokens fed to both paths:
    logits within 1e-2 (relative) and the same greedy choice almost everywhere; then both paths through the Engine.

    The kernels' fp32 dots run in TF32 (~1e-3 per module), and on these random weights a router top-k flip turns
    that into an O(1) change of one row, so a few rows may differ; free-running greedy runs diverge after such
    a flip and are reported, not asserted."""
    from decode_service.engine.engine import Engine, EngineSettings
    from decode_service.engine.request import Request, SamplingParams

    model, config, prompts = tiny_checkpoint(tmp_path, torch.float32)
    ref, fed = run(model, prompts, steps=64, ops="reference")
    fast, _ = run(model, prompts, steps=64, ops="fast", forced=fed)
    errors = sorted(rel_err(f, r) for f, r in zip(fast, ref, strict=True))
    rows = torch.cat([(f - r).norm(dim=-1) / r.norm(dim=-1) for f, r in zip(fast, ref, strict=True)])
    same = torch.cat([f.argmax(-1) == r.argmax(-1) for f, r in zip(fast, ref, strict=True)]).float().mean().item()
    print(
        f"tiny checkpoint fp32, teacher-forced 64 steps x 4 sequences: logits rel err per step median "
        f"{errors[32]:.1e} max {errors[-1]:.1e}; rows within 1e-2 {(rows <= 1e-2).float().mean().item():.0%}; "
        f"same greedy token {same:.1%}"
    )

    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    tokens = {}
    for ops in ("reference", "auto"):
        settings = EngineSettings(device="cuda", kv_cache_bytes=64 << 20, max_num_seqs=4)
        engine = Engine(model.with_ops(ops), config, settings)
        outs = engine.generate(Request(f"r{i}", p, greedy) for i, p in enumerate(prompts))
        tokens[ops] = [o.token_ids for o in outs]
    agree = [
        next((i for i, (a, b) in enumerate(zip(ra, rb, strict=True)) if a != b), len(ra))
        for ra, rb in zip(tokens["reference"], tokens["auto"], strict=True)
    ]
    print(f"tiny checkpoint fp32 engine, free-running greedy: steps equal before the first difference {agree} of 64")
    assert errors[32] <= 1e-2 and (rows <= 1e-2).float().mean().item() >= 0.9
    assert same >= 0.95
    assert all(len(t) == 64 for t in tokens["auto"])


@pytest.mark.gpu
def test_tiny_checkpoint_graphs_on_and_off_give_the_same_tokens(cuda_device, tmp_path):
    """bf16 through the Engine: 64 greedy steps of 4 sequences with the decode steps replayed from CUDA graphs and
    with the same static-buffer step run eagerly (same kernels, so the same tokens)."""
    from decode_service.engine.engine import Engine, EngineSettings
    from decode_service.engine.request import Request, SamplingParams

    model, config, prompts = tiny_checkpoint(tmp_path, torch.bfloat16)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    tokens = {}
    for graphs in (True, False):
        settings = EngineSettings(device="cuda", kv_cache_bytes=64 << 20, max_num_seqs=4, cuda_graphs=graphs)
        engine = Engine(model, config, settings)
        assert engine.runner.decode_graphs is not None
        outs = engine.generate(Request(f"r{i}", p, greedy) for i, p in enumerate(prompts))
        tokens[graphs] = [o.token_ids for o in outs]
    assert tokens[True] == tokens[False]
    assert all(len(t) == 64 for t in tokens[True])


@pytest.mark.parametrize("rows", [1, 3])
def test_argmax_logits_are_the_logits_argmax(cpu_interpreter, rows):
    """The greedy head's tokens equal `logits(...).argmax(-1)` on each path, ties included (unembedding rows that
    repeat, the first wins), over the unpadded columns only (the padded rows hold the largest product)."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen) / 8
    x = torch.randn(rows, 64, generator=gen)
    weight[[30, 57, 89]] = weight[11].clone()
    weight[90:] = weight[11] * 4  # padding past vocab = 90: never a token
    x[0] = weight[11] * 8
    for ops in (FAST, REFERENCE):
        tokens = ops.argmax_logits(x, weight, 16.0, SINGLE, 90)
        assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
        assert torch.equal(tokens, ops.logits(x, weight, 16.0, SINGLE, 90).argmax(-1))
        assert tokens[0] == 11
    assert skinny_gemm.preferred(rows, 96) == (rows == 1)  # one row took the fused argmax, three the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax(cpu_interpreter, dtype):
    """The row argmax of a strided view (a product's unpadded columns) is torch.argmax's: the first of equal
    values, NaN above +inf."""
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(4, 5000, generator=gen).to(dtype)
    values[0, [7, 4100]] = 9.0  # a tie across the kernel's column chunks: the first wins
    values[1, 3000] = float("inf")
    values[2, [10, 2500]] = float("nan")
    view = values[:, :4500]
    for ops in (FAST, REFERENCE):
        tokens = ops.argmax_rows(view)
        assert tokens.dtype == torch.int64 and torch.equal(tokens, view.argmax(-1))
    assert FAST.argmax_rows(view)[:3].tolist() == [7, 3000, 10]
