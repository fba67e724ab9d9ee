"""In-process generation on a checkpoint (no services): what `inkling-epd generate --local` runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.checkpoint import CheckpointFiles, load_decoder_weights
from common.config import ModelConfig, load_model_config
from common.errors import InvalidInputError
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.inkling import InklingDecoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LocalGenerator:
    config: ModelConfig
    model: InklingDecoder

    @classmethod
    def load(cls, checkpoint: str | Path, device: str = "cpu", dtype: str = "float32") -> LocalGenerator:
        config = load_model_config(checkpoint)
        weights, _ = load_decoder_weights(CheckpointFiles(checkpoint), config, dtype=DTYPES[dtype], device=device)
        return cls(config, InklingDecoder.from_weights(config.text, weights, DTYPES[dtype], device))

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_tokens: int) -> dict:
        """Greedy decoding until an EOS id of the config or `max_tokens`."""
        vocab = self.config.text.unpadded_vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInputError(f"prompt_token_ids: out of range [0, {vocab}): {bad[:10]}")
        device = self.model.embed.weight.device
        state = self.model.new_state()
        tokens, out, finish = list(prompt_ids), [], "length"
        step_ids, pos = tokens, 0
        while len(out) < max_tokens:
            ids = torch.tensor(step_ids, dtype=torch.long, device=device)
            hidden = self.model(ForwardBatch(ids, [SequenceSlice(pos, len(step_ids), state.layers)]))
            pos += len(step_ids)
            token = int(self.model.logits(hidden[-1:]).argmax(-1))
            out.append(token)
            if token in self.config.eos_token_ids:
                finish = "stop"
                break
            step_ids = [token]
        return {"prompt_token_ids": list(prompt_ids), "token_ids": out, "text": _detokenize(out),
                "finish_reason": finish}


def _detokenize(ids: list[int]) -> str:
    from decode_service.chat import decode_tokens

    return decode_tokens(ids)
