"""The invariant suite, once per family (and the llama3-scaled variant)."""

from tests.families.suite import EditSuite, FamilySuite


class TestLlama(FamilySuite, EditSuite):
    name = "tiny-llama"


class TestLlama3Scaling(FamilySuite, EditSuite):
    name = "tiny-llama3"


class TestQwen2(FamilySuite, EditSuite):
    name = "tiny-qwen2"


class TestQwen3(FamilySuite, EditSuite):
    name = "tiny-qwen3"


class TestGemma2(FamilySuite, EditSuite):
    name = "tiny-gemma2"


class TestGemma3(FamilySuite, EditSuite):
    name = "tiny-gemma3"


class TestMistral(FamilySuite, EditSuite):
    name = "tiny-mistral"
