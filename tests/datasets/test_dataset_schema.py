from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvprobe.datasets import EditCase


def test_valid_case_and_frozen(case_data):
    case = EditCase(**case_data)
    assert case.record == [("item", "jacket"), ("nonce", "n4821")]
    with pytest.raises(ValidationError):
        case.field = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"new_value": "delivered"}, "must differ"),
        ({"expected_new": "maybe"}, "not one of options"),
        ({"options": ["yes", "yes"], "expected_new": "yes"}, "distinct"),
        ({"options": ["yes"]}, "give two answer options, or none"),
        ({"control": True}, "control case must keep"),
        ({"expected_new": "yes"}, "must flip"),
        ({"old_value": " delivered"}, "surrounding spaces"),
        ({"new_value": "a\nb"}, "one line"),
        ({"record": [["order_status", "x"]]}, "must not repeat"),
        ({"field_position": "end"}, "early"),
        ({"colour": "red"}, "Extra inputs"),
    ],
)
def test_validators_reject(case_data, change, message):
    with pytest.raises(ValidationError, match=message):
        EditCase(**{**case_data, **change})


def test_control_case_keeps_answer(case_data):
    data = {**case_data, "field": "nonce", "old_value": "n1", "new_value": "n2", "control": True}
    data.update(expected_new="yes", record=[["order_status", "delivered"]])
    assert EditCase(**data).control
