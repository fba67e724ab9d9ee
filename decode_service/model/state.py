"""Per-sequence decoder state: the KV history of every layer plus its four short-conv states.

The model only talks to the `LayerCache` protocol, so the engine can back it with paged pools (KV pages, conv slots)
while tests and the `--local` path use the contiguous `SequenceState` below. Positions are absolute: a sequence's
next token is at `num_tokens`, and every write advances KV and conv state together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from common.config import TextConfig

# Conv state index per layer (spec inkling-text 4.1).
K_CONV, V_CONV, ATTN_CONV, MLP_CONV = 0, 1, 2, 3


class PagedPools(Protocol):
    """The engine's paged pools as the batched decode path sees them (`decode_service.engine.kv_cache.KVCache`)."""

    page_size: int

    def kv_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Layer `layer`'s key and value rows `[pages * page_size, nKV, hd]` and whether it is a sliding layer."""
        ...

    def conv_pool(self, layer: int, index: int) -> torch.Tensor:
        """Conv `index` of layer `layer` for every slot, `[slots, K-1, C]`."""
        ...


class LayerCache(Protocol):
    """What one decoder layer of one sequence needs from its cache."""

    def append_kv(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store k, v `[n, nKV, hd]` for positions `start..start+n-1`; return every key/value still visible to
        these queries `[m, nKV, hd]` and the absolute position of the first returned row."""
        ...

    def conv_state(self, index: int) -> torch.Tensor:
        """The last K-1 inputs of conv `index`, `[K-1, C]` (oldest first; zeros for a fresh sequence)."""
        ...

    def set_conv_state(self, index: int, state: torch.Tensor) -> None: ...


@dataclass
class PagedKV:
    """Where one layer's visible keys of a sequence live in the engine's paged pools (nothing copied)."""

    k_pool: torch.Tensor  # [pages * page_size, nKV, hd], the layer's whole pool
    v_pool: torch.Tensor
    pages: torch.Tensor  # [n] int64 on the pools' device: the page of positions first // page_size ..
    page_size: int
    first: int  # absolute position of the first visible key


@runtime_checkable
class PagedLayerCache(LayerCache, Protocol):
    """A `LayerCache` over paged pools, which can also hand out its visible keys in place."""

    def append_kv_paged(self, k: torch.Tensor, v: torch.Tensor, start: int) -> PagedKV:
        """Store k, v like `append_kv`; return where every key visible to these queries lives instead of a copy."""
        ...


@dataclass
class ContiguousLayerCache:
    """Reference cache for one layer: contiguous KV tensors; sliding layers keep only what the window needs."""

    window: int | None  # sliding window W (query sees itself + W-1 previous), None = keep everything
    conv: list[torch.Tensor]  # 4 x [K-1, C]
    k: torch.Tensor | None = None  # [m, nKV, hd]
    v: torch.Tensor | None = None
    first_position: int = 0  # absolute position of k[0]

    def append_kv(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.k is None:
            self.k, self.v, self.first_position = k, v, start
        else:
            assert self.first_position + self.k.shape[0] == start, "KV append must continue the sequence"
            self.k = torch.cat([self.k, k])
            self.v = torch.cat([self.v, v])
        visible_k, visible_v, visible_first = self.k, self.v, self.first_position
        if self.window is not None:
            # Queries after this step only look back W-1 tokens from the last one stored.
            keep = self.window - 1
            drop = max(0, self.k.shape[0] - keep)
            if drop:
                self.k, self.v = self.k[drop:], self.v[drop:]
                self.first_position += drop
        return visible_k, visible_v, visible_first

    def conv_state(self, index: int) -> torch.Tensor:
        return self.conv[index]

    def set_conv_state(self, index: int, state: torch.Tensor) -> None:
        self.conv[index] = state


@dataclass
class SequenceState:
    """All caches of one sequence (contiguous reference implementation)."""

    layers: list[ContiguousLayerCache]
    num_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def fresh(
        cls, config: TextConfig, device: torch.device | str = "cpu", conv_dtype: torch.dtype = torch.float32
    ) -> SequenceState:
        k1 = config.conv_kernel_size - 1
        layers = []
        for layer in range(config.num_layers):
            geo = config.layer_geometry(layer)
            widths = (geo.kv_width, geo.kv_width, config.hidden_size, config.hidden_size)
            conv = [torch.zeros(k1, c, device=device, dtype=conv_dtype) for c in widths]
            layers.append(ContiguousLayerCache(window=geo.window, conv=conv))
        return cls(layers=layers)

    def clone(self) -> SequenceState:
        layers = [
            ContiguousLayerCache(
                window=c.window, conv=[s.clone() for s in c.conv], k=c.k, v=c.v, first_position=c.first_position
            )
            for c in self.layers
        ]
        return SequenceState(layers=layers, num_tokens=self.num_tokens)
