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
    """Tool calling, structured output and multimodal inputs do not apply: the flags below
    (and the suite's defaults) skip them, each with its reason in the report."""

    @property
    def chat_model_class(self):
        return ChatLookahead

    @property
    def chat_model_params(self):
        return {"max_tokens": 24}

    @property
    def has_tool_calling(self):
        return False

    @property
    def has_structured_output(self):
        return False


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
