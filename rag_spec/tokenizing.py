"""Tokenizers shared by threads: Hugging Face fast tokenizers are not thread-safe (concurrent
calls with different truncation or padding settings fail with "Already borrowed"), and
rag-spec calls them from callers' threads, the RaLM loop and verification workers alike."""

from __future__ import annotations

import threading
import weakref
from typing import Any

_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_locks_lock = threading.Lock()


def tokenizer_lock(tokenizer: Any) -> threading.RLock:
    """The one lock every rag-spec call on ``tokenizer`` holds."""
    with _locks_lock:
        lock = _locks.get(tokenizer)
        if lock is None:
            lock = _locks[tokenizer] = threading.RLock()
        return lock


class SerialTokenizer:
    """``tokenizer`` with every method call serialised by its lock; other attributes pass
    through. rag-spec wraps the tokenizers it is given; the caller's object is unchanged."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner = tokenizer
        self._lock = tokenizer_lock(tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def serialised(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return value(*args, **kwargs)
        return serialised


def serial(tokenizer: Any) -> Any:
    """A SerialTokenizer for ``tokenizer`` (None stays None; a wrapped one is kept)."""
    if tokenizer is None or isinstance(tokenizer, SerialTokenizer):
        return tokenizer
    return SerialTokenizer(tokenizer)
