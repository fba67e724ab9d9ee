"""When a request ends after a token was appended (stop strings are the output parser's job)."""

from __future__ import annotations

from collections.abc import Sequence

from decode_service.engine.request import FinishReason, Request


def check_stop(
    request: Request, eos_token_ids: Sequence[int], max_model_len: int, constraint_finished: bool = False
) -> FinishReason | None:
    """After a token was appended: a structured-output constraint the sampler reports complete, or EOS (unless
    ignore_eos) or a stop token id once min_tokens were generated -> STOP; max_tokens (None: no per-request cap)
    or the context limit -> LENGTH."""
    p, token, n = request.sampling, request.output_token_ids[-1], len(request.output_token_ids)
    if constraint_finished:
        return FinishReason.STOP
    if n >= p.min_tokens and ((not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids):
        return FinishReason.STOP
    if (p.max_tokens is not None and n >= p.max_tokens) or request.num_prompt_tokens + n >= max_model_len:
        return FinishReason.LENGTH
    return None
