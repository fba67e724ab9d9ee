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


def test_min_tokens_holds_off_eos_and_stop_ids_and_unset_max_tokens_has_no_cap():
    eos = (3,)
    r = req(max_tokens=None, min_tokens=3, stop_token_ids=(7,))
    for early in ([3], [5, 7]):
        r.output_token_ids = early
        assert check_stop(r, eos, 100) is None
    r.output_token_ids = [5, 6, 3]
    assert check_stop(r, eos, 100) is FinishReason.STOP
    r.output_token_ids = [5] * 90
    assert check_stop(r, eos, 100) is None  # no max_tokens: only the context limit ends it
    r.output_token_ids = [3]
    assert check_stop(r, eos, 3) is FinishReason.LENGTH  # the context limit wins over min_tokens


def test_a_finished_constraint_stops_even_before_min_tokens_and_with_ignore_eos():
    r = req(max_tokens=10, min_tokens=5, ignore_eos=True)
    r.output_token_ids = [5]
    assert check_stop(r, (3,), 100) is None
    assert check_stop(r, (3,), 100, constraint_finished=True) is FinishReason.STOP
