"""LangChain's own standard test suites, run against the embedded model and knowledge base."""

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_rag_spec import ChatLookahead, SpecRetriever

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("user_cache")]

class TestChatLookaheadUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatLookahead


class TestChatLookaheadIntegration(ChatModelIntegrationTests):
    """Tool calling, tool choice, structured output and JSON mode on (multimodal inputs do
    not apply). The embedded 135M model decides some of the suite's tests itself: those are
    marked xfail below, each with what the model does; the machinery they need (forced calls,
    grammars, parsing) is tested in tests/test_structured.py and tests/test_langchain.py."""

    @property
    def chat_model_class(self):
        return ChatLookahead

    @property
    def chat_model_params(self):
        return {"max_tokens": 160}  # a tool call with unicode arguments takes ~80

    @property
    def has_tool_calling(self):
        return True

    @property
    def has_tool_choice(self):
        return True

    @property
    def has_structured_output(self):
        return True

    @property
    def supports_json_mode(self):
        return True

    @pytest.mark.xfail(reason="the 135M model answers the weather question in text: with "
                       "tool_choice='auto' whether to call is the model's choice (it answered "
                       "4 of 4 weather questions in text under three system-prompt wordings); "
                       "the agent loop itself runs in tests/test_agents.py with tools_first")
    def test_agent_loop(self, model):
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason="the 135M model's joke setup is a JSON string it never closes "
                       "within max_tokens: the cut answer raises OutputParserException, as it "
                       "must, never a partial object")
    def test_structured_output_optional_param(self, model):
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason="in JSON mode (any JSON object) the 135M model's string never "
                       "closes within max_tokens: the cut answer raises, as it must")
    def test_json_mode(self, model):
        super().test_json_mode(model)


class TestSpecRetrieverIntegration(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self):
        return SpecRetriever

    @property
    def retriever_constructor_params(self):
        return {"kind": "flat"}

    @property
    def retriever_query_example(self):
        return "How do I join two path components?"
