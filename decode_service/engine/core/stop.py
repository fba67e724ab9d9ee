"""When a request ends after a token was appended (stop strings are the output parser's job)."""

from __future__ import annotations

from collections.abc import Sequence

from decode_service.engine.request import FinishReason, Request


def check_stop(request: Request, eos_token_ids: Sequence[int], max_model_len: int) -> FinishReason | None:
    """After a token was appended: EOS (unless ignore_eos) or a stop token id -> STOP; max_tokens or the
    context limit -> LENGTH."""
    p, token = request.sampling, request.output_token_ids[-1]
    if (not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids:
        return FinishReason.STOP
    if len(request.output_token_ids) >= p.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
