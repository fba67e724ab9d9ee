"""The paged backend's fusions: each residual conv emits the RMSNorm that reads its output next, and the KV
prologue q-norms the queries, so a decode step launches no RMSNorm of its own but embed_norm's and the first
layer's attn_norm."""

from __future__ import annotations

import torch

import kernels.rms_norm
import kernels.short_conv
from decode_service.engine.worker.decode_graphs import DecodeGraphs
from decode_service.engine.worker.kv_cache import CacheSpec, KVCache
from decode_service.model.paged import PagedBackend, PagedBatch
from tests.decode_service.model.test_fast_path import tiny_model


def test_each_residual_conv_is_fused_with_the_norm_that_reads_it_next():
    model = tiny_model().with_ops("fast")
    plan, layers = model.paged.norm_after, model.layers
    assert len(plan) == 2 * len(layers)
    for i, layer in enumerate(layers):
        assert plan[layer.attn_sconv] is layer.mlp_norm
        assert plan[layer.mlp_sconv] is (layers[i + 1].attn_norm if i + 1 < len(layers) else model.norm)
    assert not PagedBackend().norm_after  # a backend built without layers fuses nothing


def test_fused_norm_answers_only_for_the_last_conv_output_and_its_norm():
    model = tiny_model()
    norm, other = model.layers[0].mlp_norm, model.layers[0].attn_norm
    out, normed = torch.randn(2, 64), torch.randn(2, 64)
    step = PagedBatch(decode=None, norm_after={}, normed=(out, norm, normed))
    assert step.fused_norm(norm, out) is normed
    assert step.fused_norm(other, out) is None  # another norm of the same rows
    assert step.fused_norm(norm, out.clone()) is None  # other rows
    assert PagedBatch(decode=None, norm_after={}).fused_norm(norm, out) is None


def test_a_paged_step_launches_two_rms_norms(cpu_interpreter, monkeypatch):
    """One step of padding rows through `DecodeGraphs` (eager on CPU): every residual conv normalises, the
    prologues norm the queries; the standalone RMSNorms left are embed_norm's and layer 0's attn_norm."""
    model = tiny_model().with_ops("fast")
    config = model.config
    cache = KVCache(config, CacheSpec(4, 16, 16, 3, torch.float32, "cpu"))
    graphs = DecodeGraphs(model, cache, max_num_seqs=2, max_model_len=16)
    norms, convs, prologues = [], [], []
    rms_norm, conv_decode, kv_prologue = (
        kernels.rms_norm.rms_norm,
        kernels.short_conv.conv_decode,
        kernels.short_conv.kv_prologue,
    )
    monkeypatch.setattr(kernels.rms_norm, "rms_norm", lambda x, *a, **k: norms.append(x.shape) or rms_norm(x, *a, **k))
    monkeypatch.setattr(kernels.short_conv, "conv_decode", lambda *a: convs.append(a[5] is not None) or conv_decode(*a))
    monkeypatch.setattr(
        kernels.short_conv, "kv_prologue", lambda *a: prologues.append(a[12] is not None) or kv_prologue(*a)
    )
    with torch.inference_mode():
        graphs.warm_up(2)
    assert norms == [(2, config.hidden_size)] * 2
    assert convs == [True] * (2 * config.num_layers)
    assert prologues == [True] * config.num_layers
