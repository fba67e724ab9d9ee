"""In-process generation on a checkpoint (no services): what `inkling-epd generate --local` runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.checkpoint import CheckpointFiles, load_decoder_weights
from common.config import ModelConfig, load_model_config
from decode_service.chat import decode_tokens
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import Request, SamplingParams
from decode_service.model.inkling import InklingDecoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LocalGenerator:
    config: ModelConfig
    model: InklingDecoder
    device: str = "cpu"

    @classmethod
    def load(cls, checkpoint: str | Path, device: str = "cpu", dtype: str = "float32") -> LocalGenerator:
        config = load_model_config(checkpoint)
        weights, _ = load_decoder_weights(CheckpointFiles(checkpoint), config, dtype=DTYPES[dtype], device=device)
        return cls(config, InklingDecoder.from_weights(config.text, weights, DTYPES[dtype], device), device)

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None) -> dict:
        """Greedy (unless `sampling` says otherwise) until an EOS id of the config or `max_tokens`."""
        sampling = sampling or SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine = Engine(self.model, self.config, EngineSettings(device=self.device, kv_cache_bytes=64 << 20))
        (out,) = engine.generate([Request("local", list(prompt_ids), sampling)])
        return {
            "prompt_token_ids": list(prompt_ids),
            "token_ids": out.token_ids,
            "text": decode_tokens(out.token_ids),
            "finish_reason": out.finish_reason,
        }
