from __future__ import annotations

from decode_service.engine.core.stop import check_stop
from decode_service.engine.request import FinishReason, Request, SamplingParams


def req(**params) -> Request:
    return Request("r", [1, 2], SamplingParams(**params))


def test_check_stop():
    eos = (3,)
    r = req(max_tokens=3, stop_token_ids=(7,))
    r.output_token_ids = [5]
    assert check_stop(r, eos, 100) is None
    r.output_token_ids = [5, 3]
    assert check_stop(r, eos, 100) is FinishReason.STOP
    r.output_token_ids = [5, 7]
    assert check_stop(r, eos, 100) is FinishReason.STOP
    r.output_token_ids = [5, 6, 8]
    assert check_stop(r, eos, 100) is FinishReason.LENGTH
    r.output_token_ids = [5]
    assert check_stop(r, eos, 3) is FinishReason.LENGTH  # 2 prompt + 1 output reach the context limit
    ignoring = req(max_tokens=5, ignore_eos=True)
    ignoring.output_token_ids = [3]
    assert check_stop(ignoring, eos, 100) is None
