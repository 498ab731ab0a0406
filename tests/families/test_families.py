"""The invariant suite, once per family (and the llama3-scaled variant)."""

from tests.families.suite import FamilySuite


class TestLlama(FamilySuite):
    name = "tiny-llama"


class TestLlama3Scaling(FamilySuite):
    name = "tiny-llama3"


class TestQwen2(FamilySuite):
    name = "tiny-qwen2"


class TestQwen3(FamilySuite):
    name = "tiny-qwen3"


class TestGemma2(FamilySuite):
    name = "tiny-gemma2"


class TestGemma3(FamilySuite):
    name = "tiny-gemma3"


class TestMistral(FamilySuite):
    name = "tiny-mistral"
