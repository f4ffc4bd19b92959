"""Async retrieval never waits behind a generation on the compute thread."""

import asyncio
import threading

from conftest import HashRetriever
from rag_spec.drafters.trie_drafter import TrieDrafter
from rag_spec.models import load_model
from rag_spec.retrieval.batching import BatchingRetriever
from rag_spec.serving.local_lm import GenerateOptions, LocalLM


class HeldDrafter(TrieDrafter):
    """Holds the generation at its first draft, on the compute thread, until ``released``:
    a retrieval queued behind that thread could not finish meanwhile."""

    def __init__(self):
        super().__init__()
        self.generating, self.released, self.held = threading.Event(), threading.Event(), None

    def propose(self, requests, target):
        if self.held is None:
            self.generating.set()
            self.held = self.released.wait(30)  # bounded: only a queued retrieval waits it out
        return super().propose(requests, target)


async def test_a_retrieval_does_not_queue_behind_a_generation(tiny_model_dir):
    drafter = HeldDrafter()
    lm = LocalLM(load_model(tiny_model_dir), draft=drafter)
    retriever = BatchingRetriever(HashRetriever())
    order = []

    async def generate():
        await lm.agenerate(["the cat sat"], GenerateOptions(max_new_tokens=20))
        order.append("generation")

    async def retrieve():
        await asyncio.to_thread(drafter.generating.wait, 30)  # the compute thread is busy now
        await retriever.asearch(["alpha beta"], k=2)
        order.append("retrieval")
        drafter.released.set()

    await asyncio.gather(generate(), retrieve())
    assert order == ["retrieval", "generation"] and drafter.held
