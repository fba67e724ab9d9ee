import pytest

from common.errors import InvalidInputError
from common.request_ids import check_request_id


@pytest.mark.parametrize("value", ["", "req-1", "a" * 128, "tenant/42:7"])
def test_accepted(value):
    assert check_request_id(value) == value


@pytest.mark.parametrize("value", ["a" * 129, "two\nlines", "tab\there", "caf\u00e9", "\x00"])
def test_rejected_with_the_field_named(value):
    with pytest.raises(InvalidInputError, match="request_id"):
        check_request_id(value)
