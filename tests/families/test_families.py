"""The invariant suite, once per family (and the llama3-scaled variant)."""

from tests.families.suite import EditSuite, FamilySuite, ProbeSuite


class TestLlama(FamilySuite, EditSuite, ProbeSuite):
    name = "tiny-llama"


class TestLlama3Scaling(FamilySuite, EditSuite, ProbeSuite):
    name = "tiny-llama3"


class TestQwen2(FamilySuite, EditSuite, ProbeSuite):
    name = "tiny-qwen2"


class TestQwen3(FamilySuite, EditSuite, ProbeSuite):
    name = "tiny-qwen3"


class TestGemma2(FamilySuite, EditSuite, ProbeSuite):
    name = "tiny-gemma2"


class TestGemma3(FamilySuite, EditSuite, ProbeSuite):
    name = "tiny-gemma3"


class TestMistral(FamilySuite, EditSuite, ProbeSuite):
    name = "tiny-mistral"
