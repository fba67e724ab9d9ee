"""The audio tower where the embeddings are fused: dMel codes off the wire -> the rows the encoder would send.

An audio clip travels as its dMel codes (`common.wire.KIND_DMEL_CODES`): the audio tower is only a codebook sum
plus an RMSNorm (spec multimodal 3.5), so the decode replica holds that tower (`model.audio.*`, 5.2 M parameters
for Small; never the vision tower) and runs it on the codes. It runs in the dtype the encoder's tower ran in
(the item's `tower_dtype`) and rounds to bf16 as the encoder does before it sends rows, so on the same kind of
device the rows are bit-identical to the encoder's.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from common.checkpoint import AUDIO, CheckpointFiles, load_tower_weights
from common.config import AudioConfig, load_model_config
from common.dtypes import TORCH_DTYPES
from common.errors import UnavailableError
from common.wire import KIND_DMEL_CODES, EncodedItem, bytes_to_codes
from encoder_service.towers import AudioTower, build_audio_tower


class AudioCodebook:
    """The audio tower's weights as stored, with one `AudioTower` per compute dtype built on first use."""

    def __init__(self, config: AudioConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self._state = state
        self._towers: dict[str, AudioTower] = {}
        self._lock = threading.Lock()  # rows() runs on worker threads

    @classmethod
    def load(cls, checkpoint: str | Path, device: torch.device | str = "cpu") -> AudioCodebook | None:
        """The audio tower of a checkpoint (stored dtypes), or None when the config has no audio tower."""
        config = load_model_config(checkpoint)
        if config.audio is None:
            return None
        state, _ = load_tower_weights(CheckpointFiles(checkpoint), AUDIO, config, None, device)
        return cls(config.audio, state, device)

    def tower(self, dtype: str) -> AudioTower:
        with self._lock:
            if dtype not in self._towers:
                self._towers[dtype] = build_audio_tower(self.config, self._state, self.device, TORCH_DTYPES[dtype])
            return self._towers[dtype]

    def rows(self, item: EncodedItem, name: str) -> torch.Tensor:
        """A `KIND_DMEL_CODES` item -> its `[rows, dim]` bf16 rows on the CPU. `name` (e.g. "media[2] (audio)")
        heads every error: a codes payload that does not fit this tower raises `UnavailableError`."""
        cfg = self.config
        if item.kind != KIND_DMEL_CODES:
            raise UnavailableError(f"{name}: expected dMel codes, got a {item.kind} payload")
        if item.codes_per_row != cfg.n_mel_bins or item.dim != cfg.output_dim:
            raise UnavailableError(
                f"{name}: dMel codes of {item.codes_per_row} mel bins for rows of width {item.dim}; this replica's "
                f"audio tower takes {cfg.n_mel_bins} bins and gives rows of width {cfg.output_dim}"
            )
        if item.tower_dtype not in TORCH_DTYPES:
            raise UnavailableError(f"{name}: dMel codes for an audio tower in unknown dtype {item.tower_dtype!r}")
        codes = bytes_to_codes(item.payload, item.rows, item.codes_per_row)  # [F, M] uint8
        if codes.size and int(codes.max()) >= cfg.mel_vocab_size:
            frame, mel = (int(i) for i in divmod(int(codes.argmax()), item.codes_per_row))
            raise UnavailableError(
                f"{name}: corrupt dMel codes: frame {frame}, mel bin {mel} holds code {int(codes[frame, mel])}, "
                f"the audio tower has {cfg.mel_vocab_size} codes per bin"
            )
        with torch.inference_mode():
            out = self.tower(item.tower_dtype)(torch.from_numpy(codes.copy()).to(self.device))  # [F, D]
        return out.to(torch.bfloat16).cpu()


__all__ = ["AudioCodebook"]
