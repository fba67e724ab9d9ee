"""The paged backend's decode step: the KV prologue q-norms the queries in its launch, so the step's standalone
RMSNorms are the residual stream's alone (embed_norm, attn_norm and mlp_norm per layer, the final norm)."""

from __future__ import annotations

import torch

import inkling_kernels.rms_norm
import inkling_kernels.short_conv
from decode_service.engine.worker.decode_graphs import DecodeGraphs
from decode_service.engine.worker.kv_cache import CacheSpec, KVCache
from tests.decode_service.model.test_fast_path import tiny_model


def test_a_paged_step_norms_the_queries_in_the_prologue(cpu_interpreter, monkeypatch):
    """One step of padding rows through `DecodeGraphs` (eager on CPU)."""
    model = tiny_model().with_ops("fast")
    config = model.config
    cache = KVCache(config, CacheSpec(4, 16, 16, 3, torch.float32, "cpu"))
    graphs = DecodeGraphs(model, cache, max_num_seqs=2, max_model_len=16)
    norms, prologues = [], []
    rms_norm, kv_prologue = inkling_kernels.rms_norm.rms_norm, inkling_kernels.short_conv.kv_prologue
    monkeypatch.setattr(
        inkling_kernels.rms_norm, "rms_norm", lambda x, *a: norms.append(tuple(x.shape)) or rms_norm(x, *a)
    )
    monkeypatch.setattr(
        inkling_kernels.short_conv, "kv_prologue", lambda *a: prologues.append(a[12] is not None) or kv_prologue(*a)
    )
    with torch.inference_mode():
        graphs.warm_up(2)
    assert norms == [(2, config.hidden_size)] * (2 * config.num_layers + 2)
    assert prologues == [True] * config.num_layers
