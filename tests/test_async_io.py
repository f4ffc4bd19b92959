"""Async retrieval never waits behind a generation on the compute thread."""

import asyncio
import time

from conftest import HashRetriever
from rag_spec.retrieval.batching import BatchingRetriever
from rag_spec.serving.local_lm import GenerateOptions, LocalLM


async def test_a_retrieval_does_not_queue_behind_a_generation(tiny_model_dir):
    lm = LocalLM.shared(tiny_model_dir)
    retriever = BatchingRetriever(HashRetriever())
    finished = {}

    async def generate():
        await lm.agenerate(["the cat sat"], GenerateOptions(max_new_tokens=200))
        finished["generation"] = time.perf_counter()

    async def retrieve():
        await asyncio.sleep(0.01)  # the generation has the compute thread by now
        await retriever.asearch(["alpha beta"], k=2)
        finished["retrieval"] = time.perf_counter()

    await asyncio.gather(generate(), retrieve())
    assert finished["retrieval"] < finished["generation"]
