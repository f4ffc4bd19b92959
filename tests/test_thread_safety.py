"""Shared objects under concurrent callers: tokenizers, the trie's memory, pending context."""

import threading
import time

import torch

from conftest import char_tokenizer, tiny_llama
from rag_spec.drafters.trie_drafter import TrieDrafter
from rag_spec.engine.decoder import LookaheadDecoder
from rag_spec.models import LoadedModel
from rag_spec.serving.local_lm import GenerateOptions, LocalLM
from test_decoder_greedy import repetitive_prompt


class BorrowChecking:
    """A tokenizer that fails like a Hugging Face fast tokenizer used by two threads at once
    ("Already borrowed"), with a window wide enough to make overlaps likely."""

    def __init__(self, tokenizer):
        self._inner, self._busy = tokenizer, threading.Lock()

    def _borrow(self, fn, *args, **kwargs):
        if not self._busy.acquire(blocking=False):
            msg = "Already borrowed"
            raise RuntimeError(msg)
        try:
            time.sleep(0.002)
            return fn(*args, **kwargs)
        finally:
            self._busy.release()

    def __call__(self, *args, **kwargs):
        return self._borrow(self._inner, *args, **kwargs)

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if callable(value):
            return lambda *a, **k: self._borrow(value, *a, **k)
        return value


def test_concurrent_callers_never_use_a_tokenizer_at_once():
    tokenizer = BorrowChecking(char_tokenizer())
    lm = LoadedModel(tiny_llama(seed=8, vocab_size=35), tokenizer, "tiny", torch.device("cpu"),
                     torch.float32)
    local = LocalLM(lm, batch_wait_ms=1)
    errors = []

    def ask(i):
        try:
            for j in range(3):
                local.generate([f"the cat {i} {j}", [{"role": "user", "content": "hi"}]][:1],
                               GenerateOptions(max_new_tokens=8, stop=("zz",)))
        except BaseException as error:
            errors.append(error)

    lm.tokenizer.chat_template = None
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_the_tries_memory_is_never_read_while_it_changes():
    drafter = TrieDrafter(branch_length=6, memory_mb=0.5)  # small: remembering decays often
    rng = torch.Generator().manual_seed(0)
    outputs = [torch.randint(3, 20, (80,), generator=rng).tolist() for _ in range(100)]
    errors = []
    stop = threading.Event()

    def remember():
        try:
            for output in outputs * 3:
                drafter.remember(output)
        except BaseException as error:
            errors.append(error)
        finally:
            stop.set()

    def propose():
        try:
            session = drafter.session([1, 2, 3])
            while not stop.is_set():
                for output in outputs[:10]:
                    session.propose(output[:5], 64)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=f) for f in (remember, propose, propose)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_add_context_reaches_only_the_calling_threads_next_generate(model, tokenizer):
    seen = {}

    class Recording(TrieDrafter):
        def session(self, prompt, extra_context=()):
            seen[threading.current_thread().name] = [list(d) for d in extra_context]
            return super().session(prompt, extra_context)

    decoder = LookaheadDecoder(model, tokenizer, drafter=Recording())
    added, other_done = threading.Event(), threading.Event()

    def with_context():
        try:
            decoder.add_context(["abc"])
        finally:  # as below: a failure here must fail the test, not leave the other waiting
            added.set()
        other_done.wait()  # the other thread generates between this one's add and generate
        decoder.generate(repetitive_prompt(0), 3)

    def without_context():
        added.wait()
        try:
            decoder.generate(repetitive_prompt(1), 3)
        finally:  # a failure here must fail the test, not leave the other thread waiting
            other_done.set()

    threads = [threading.Thread(target=with_context, name="a"),
               threading.Thread(target=without_context, name="b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    abc = tokenizer(["abc"], add_special_tokens=False)["input_ids"]
    assert seen == {"a": abc, "b": []}
