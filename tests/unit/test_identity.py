"""A model's identity has one home, kvprobe.identity (issue 51): its keys, its record and its check."""

from __future__ import annotations

import re
from pathlib import Path

from kvprobe.identity import HASHES, KEYS, ModelIdentity, malformed
from tests.conftest import tiny_model

SRC = Path(__file__).resolve().parents[2] / "src" / "kvprobe"


def test_a_loaded_model_s_identity_is_its_fingerprint_in_the_order_files_write():
    lm = tiny_model("tiny-llama")
    fp = lm.fingerprint()
    ident = ModelIdentity.of_model(lm)
    assert list(fp) == ["spec", *KEYS] and ident.as_dict() == fp and ModelIdentity.of(fp) == ident
    assert ident.content() == {k: fp[k] for k in KEYS} and "spec" not in ident.content()
    assert ident.differ(fp) == [] and ident.differ({**fp, "spec": "elsewhere"}) == []  # a path is not an identity
    other = {**fp, "weights_hash": "0" * 16, "family": "qwen2"}
    assert ident.differ(other) == ["family", "weights_hash"] and ident.differ(other, HASHES) == ["weights_hash"]
    assert ident.differ({}) == list(KEYS)  # a key missing from a file differs
    assert malformed(fp) == [] and malformed({**fp, "config_hash": 3}) == ["config_hash"]
    assert malformed(None) == list(KEYS)


def test_no_other_module_spells_the_identity_keys():
    """Results folders, both policies, block stores and Ray workers take the keys from kvprobe.identity, so a
    key added there is recorded and checked by all of them."""
    spelled = re.compile(r"[\"']config_hash[\"'],\s*[\"']weights_hash[\"']")
    homes = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if spelled.search(p.read_text()))
    assert homes == [], homes
    assert KEYS == ("family", "config_hash", "weights_hash", "tokenizer_hash")

