"""Fixtures for the engine tests: a tiny text config, a cheap fake decoder that exercises the cache contract, a
random-weight `InklingDecoder`, and the one-sequence reference generation on the contiguous `SequenceState`."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import ModelConfig, TextConfig, parse_model_config
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.inkling import InklingDecoder
from decode_service.model.state import SequenceState
from tools.make_tiny_checkpoint import make_tiny_checkpoint

EOS = 3
TINY_TEXT = {
    "model_type": "inkling",
    "vocab_size": 96,
    "unpadded_vocab_size": 90,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 8,
    "sliding_window_size": 8,
    "d_rel": 4,
    "rel_extent": 12,
    "log_scaling_n_floor": 10,
    "local_layer_ids": [0, 1],
    "dense_mlp_idx": 1,
    "dense_intermediate_size": 48,
    "intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "route_scale": 2.0,
    "logits_mup_width_multiplier": 4.0,
    "eos_token_id": EOS,
}


@pytest.fixture
def model_config() -> ModelConfig:
    return parse_model_config(dict(TINY_TEXT))


class FakeDecoder:
    """Stands in for `InklingDecoder` through the same `LayerCache` contract, at a fraction of the cost.

    Per layer: kv = conv_k(x Wk) is stored, and each token attends (softmax, causal, window on sliding layers)
    over every visible stored row; the four conv states all carry history. Any mix-up of pages, positions,
    windows or conv slots changes the hidden state and therefore the greedy tokens.
    """

    def __init__(self, config: TextConfig, seed: int = 0, dtype: torch.dtype = torch.float64):
        g = torch.Generator().manual_seed(seed)
        self.config, self.dtype = config, dtype
        h = config.hidden_size
        self.embed = torch.randn(config.vocab_size, h, generator=g, dtype=dtype)
        self.wk = [
            torch.randn(h, config.layer_geometry(i).kv_width, generator=g, dtype=dtype) / math.sqrt(h)
            for i in range(config.num_layers)
        ]
        self.unembed = torch.randn(config.vocab_size, h, generator=g, dtype=dtype)
        self.conv_w = torch.randn(4, config.conv_kernel_size, generator=g, dtype=dtype) * 0.5
        self.calls = 0
        self.fail_next = False

    def _conv(self, index: int, x: torch.Tensor, cache) -> torch.Tensor:
        window = torch.cat([cache.conv_state(index).to(x.dtype), x])  # [K-1+n, C]
        k, n = self.conv_w.shape[1], x.shape[0]
        y = x + sum(window[j : j + n] * self.conv_w[index, j] for j in range(k))
        cache.set_conv_state(index, window[-(k - 1) :])
        return y

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.calls += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        h = self.embed[batch.token_ids]  # [T, H]
        if batch.mm_rows is not None:
            h = h.index_copy(0, batch.mm_index, batch.mm_rows.to(h.dtype))
        for layer in range(self.config.num_layers):
            geo = self.config.layer_geometry(layer)
            outs, offset = [], 0
            for seq in batch.sequences:
                x, cache = h[offset : offset + seq.num_tokens], seq.layers[layer]
                offset += seq.num_tokens
                kv = self._conv(0, x @ self.wk[layer], cache)  # [n, kvw]
                self._conv(1, kv, cache)
                keys, _, first = cache.append_kv(
                    kv.view(-1, geo.num_kv_heads, geo.head_dim),
                    kv.view(-1, geo.num_kv_heads, geo.head_dim),
                    seq.start_position,
                )
                keys = keys.reshape(keys.shape[0], -1)  # [m, kvw]
                q_pos = torch.arange(seq.start_position, seq.start_position + seq.num_tokens)
                dist = q_pos[:, None] - torch.arange(first, first + keys.shape[0])[None, :]
                hidden = dist < 0
                if geo.window is not None:
                    hidden |= dist >= geo.window
                scores = (kv @ keys.T / math.sqrt(kv.shape[1])).masked_fill(hidden, -math.inf)
                att = torch.softmax(scores, -1) @ keys  # [n, kvw]
                y = self._conv(2, att @ self.wk[layer].T, cache)
                outs.append(self._conv(3, torch.tanh(y), cache))
            h = torch.tanh(h + torch.cat(outs))
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.unembed.T)[:, : self.config.unpadded_vocab_size].float()


@pytest.fixture
def fake_model(model_config) -> FakeDecoder:
    return FakeDecoder(model_config.text)


def random_inkling(config: TextConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
    """`InklingDecoder` with random weights large enough that every part matters."""
    torch.manual_seed(seed)
    model = InklingDecoder(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("global_scale") or name.endswith("gate.bias"):
                continue
            elif "sconv" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model.eval()


@pytest.fixture(scope="module")
def inkling_model():
    return random_inkling(parse_model_config(dict(TINY_TEXT)).text)


# The tiny model with head_dim 16 (the attention kernels' smallest), for the batched decode path.
KERNEL_TEXT = {
    **TINY_TEXT,
    "hidden_size": 64,
    "head_dim": 16,
    "swa_head_dim": 16,
    "num_key_value_heads": 2,
    "swa_num_key_value_heads": 1,
}


@pytest.fixture(scope="module")
def kernel_config() -> ModelConfig:
    return parse_model_config(dict(KERNEL_TEXT))


@pytest.fixture(scope="module")
def kernel_model(kernel_config):
    return random_inkling(kernel_config.text)


@torch.inference_mode()
def reference_greedy(
    model, config: TextConfig, prompt: list[int], max_tokens: int, eos: tuple[int, ...] = (), mm: tuple = ()
) -> list[int]:
    """One sequence on the contiguous `SequenceState`: full prefill, then one token at a time."""
    state = SequenceState.fresh(config, conv_dtype=model.dtype)
    tokens, out = list(prompt), []
    start, new = 0, list(prompt)
    while len(out) < max_tokens:
        batch = ForwardBatch(torch.tensor(new), [SequenceSlice(start, len(new), state.layers)])
        if start == 0 and mm:
            batch.mm_rows = torch.cat([item.rows for item in mm])
            batch.mm_index = torch.cat([torch.arange(item.start, item.end) for item in mm])
        hidden = model.forward(batch)
        token = int(model.logits(hidden[-1:]).argmax(-1))
        out.append(token)
        start += len(new)
        tokens.append(token)
        new = [token]
        if token in eos:
            break
    return out


@pytest.fixture
def reference():
    return reference_greedy


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory):
    """make-tiny, NVFP4, with its 2 MTP depths: the checkpoint of the tensor-parallel engine tests."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp-engine"), nvfp4=True, seed=6)
