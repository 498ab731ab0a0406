"""Shared fixtures for the dataset tests: a word-level tokenizer and a hand-written case."""

from __future__ import annotations

import pytest

from kvprobe.datasets import vocabulary
from kvprobe.datasets.words import build_word_tokenizer


@pytest.fixture(scope="session")
def word_tok():
    return build_word_tokenizer(vocabulary())


@pytest.fixture
def case_data() -> dict:
    """A valid non-control case as plain JSON data (copy and change a key to make bad ones)."""
    return {
        "case_id": "c1",
        "domain": "retail_refund",
        "field": "order_status",
        "old_value": "delivered",
        "new_value": "pending",
        "control": False,
        "system": "You are a support assistant for an online store.",
        "rule": "Approve a refund only if order_status is delivered or returned.",
        "fillers": ["Store credit expires after one year.", "Replies should be short and polite."],
        "field_position": "middle",
        "context": ["The ticket was opened this morning."],
        "record": [["item", "jacket"], ["nonce", "n4821"]],
        "question": "Should the refund be approved?",
        "options": ["yes", "no"],
        "expected_old": "yes",
        "expected_new": "no",
        "template_id": "retail_refund.t0",
        "few_shot": [],
        "cot": False,
    }
