"""Text to train a draft on that reads like what it will draft: the model's own answers.

A draft agrees with the model best on the kind of text the model writes, not on the corpus as
it stands. Measured on the embedded model's own answers to the benchmark's prompts, an exit
trained on passages alone agreed with it on fewer open-ended and RAG answer tokens than one
trained with a few hundred of the model's own answers (below) added. So an exit also trains on chat
prompts followed by the model's own greedy answers, of two kinds:

- questions about the user's passages, shown with that passage and its neighbours in the
  corpus, as a retriever would (the RAG answers it will draft);
- open-ended questions the model writes itself: given only the chat template's opening of a
  user turn, an instruct model writes a plausible user question (Magpie, Xu et al. 2024).

Answers come from ``LookaheadDecoder`` (greedy: the tokens ``generate`` gives, sooner) drafting
from the trie alone: its copies are matched, never drawn, so the sampled questions too are the
seeded draws plain sampling makes, whatever heads exist (one trained from them, among others).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_spec.corpus import Passage, fingerprint
from rag_spec.models.limits import context_window
from rag_spec.progress import progress as progress_bar
from rag_spec.prompts import chat_input_ids, rag_messages
from rag_spec.retrieval.types import Hit

_BATCH = 8  # prompts answered at once
_ASKED = 1  # bump when what ``own_answers`` asks changes: remembered answers are answered again
_MARK = "\x00rag-spec\x00"  # stands for a message's content while the template is rendered


Answer = tuple[list[int], list[int]]  # a prompt's token ids and the model's answer's


def own_answers(model: Any, tokenizer: Any, passages: Sequence[Passage], count: int, *,
                written_share: float = 0.5, max_new_tokens: int = 64, seed: int = 0,
                progress: bool = True, partial: PartialAnswers | None = None) -> list[Answer]:
    """``count`` chat prompts and the model's greedy answers to them (token ids): questions the
    model writes itself (``written_share`` of them), the rest questions about ``passages`` (all
    of them where its tokenizer has no chat template), fewer where some do not fit the model's
    context window. The model is only read. With ``partial``, the prompts and each batch's
    answers are kept there as they come, and an interrupted run's are taken up where it
    stopped (answering takes most of an hour for a draft head)."""
    from rag_spec.drafters.trie_drafter import TrieDrafter
    from rag_spec.engine.decoder import LookaheadDecoder

    decoder = LookaheadDecoder(model, tokenizer, drafter=TrieDrafter())
    prompts, answered = partial.load() if partial is not None else ([], [])
    if progress and answered and partial is not None:
        print(f"rag-spec: going on with the model's answers where a stopped run left them "
              f"({len(answered)} answered, {partial.path})", file=sys.stderr)
    if not prompts:
        prompts = _prompts(decoder, passages, count, written_share, max_new_tokens, seed,
                           progress, partial)
        if partial is not None:
            partial.save(prompts, answered)
    for start in progress_bar(range(len(answered), len(prompts), _BATCH),
                              f"the model answering {len(prompts)} prompts"
                              + (f" ({len(answered)} answered before)" if answered else ""),
                              "batch", enabled=progress):
        batch = prompts[start:start + _BATCH]
        answers = decoder.generate(batch, max_new_tokens=max_new_tokens)
        answered += [(prompt, answer.token_ids) for prompt, answer in zip(batch, answers)]
        if partial is not None:
            partial.save(prompts, answered)
    return answered


def _prompts(decoder: Any, passages: Sequence[Passage], count: int, written_share: float,
             max_new_tokens: int, seed: int, progress: bool, partial: PartialAnswers | None
             ) -> list[list[int]]:
    """The chat prompts ``own_answers`` answers, its questions written first."""
    model, tokenizer = decoder.model, decoder.tokenizer
    questions = written_questions(decoder, count - int(count * (1 - written_share)), seed=seed,
                                  progress=progress, partial=partial)
    chosen = random.Random(seed).sample(range(len(passages)), min(count - len(questions),
                                                                  len(passages)))
    prompts = [chat_input_ids(tokenizer, rag_messages(
        f"What is {passages[i].title} used for?",
        [Hit(j, 0.0, p.title, p.text) for j, p in enumerate(passages[max(i - 1, 0):i + 2])]))
        for i in chosen]
    prompts += [chat_input_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    window = context_window(model.config, tokenizer)
    if window is not None:  # a model of a short window is asked what fits
        prompts = [p for p in prompts if len(p) + max_new_tokens <= window]
    return prompts


class PartialAnswers:
    """What one ``own_answers`` run has so far, in a file: the questions it wrote (and the
    batches that wrote them), then its prompts and answers. A run that stops (interrupted,
    killed) is taken up at its last whole batch, so the batches, the questions and the answers
    are those of a run that never stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def questions(self) -> tuple[list[str], int]:
        """The questions kept and the batches that wrote them; none where none are kept."""
        try:
            kept = json.loads(self.path.read_text())
            questions, batches = [str(q) for q in kept["questions"]], int(kept["batches"])
        except (OSError, ValueError, TypeError, KeyError):
            return [], 0
        return questions, batches

    def save_questions(self, questions: Sequence[str], batches: int) -> None:
        self._write({"questions": list(questions), "batches": batches})

    def load(self) -> tuple[list[list[int]], list[Answer]]:
        """The kept prompts and answers; none where no run got that far or what it kept is
        unreadable or not a run's."""
        try:
            kept = json.loads(self.path.read_text())
            prompts = [list(map(int, prompt)) for prompt in kept["prompts"]]
            answered = [(prompts[i], list(map(int, answer)))
                        for i, answer in enumerate(kept["answers"])]
        except (OSError, ValueError, TypeError, KeyError, IndexError):
            return [], []
        if len(answered) % _BATCH and len(answered) != len(prompts):
            return [], []
        return prompts, answered

    def save(self, prompts: Sequence[Sequence[int]], answered: Sequence[Answer]) -> None:
        self._write({"prompts": prompts, "answers": [answer for _, answer in answered]})

    def _write(self, kept: dict[str, Any]) -> None:
        from rag_spec.paths import atomic_file

        with atomic_file(self.path) as scratch:
            scratch.write_text(json.dumps(kept))


def remembered_answers(model: Any, tokenizer: Any, passages: Sequence[Passage], count: int,
                       *, progress: bool = True, **asked: Any) -> list[Answer]:
    """``own_answers``, kept in rag-spec's cache: answering is most of a draft's training
    (about 40 of the draft head's 87 minutes), and the answers depend only on the model, its
    tokenizer, the passages and what is asked, so a training run that stopped, or a draft
    trained with other settings on the same answers (the exit adapter's are the head's first
    ones), answers nothing again; one stopped while answering goes on from its last batch. A
    damaged file is answered again and replaced."""
    from rag_spec.drafters.draft_head import model_fingerprint
    from rag_spec.paths import atomic_file, cache_dir

    key = json.dumps([_ASKED, model_fingerprint(model), str(model.dtype), fingerprint(passages),
                      count, sorted(asked.items()), type(tokenizer).__name__, len(tokenizer),
                      getattr(tokenizer, "chat_template", None)])
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    path = cache_dir() / "answers" / f"{digest}.json"
    if path.is_file():
        try:
            kept = [(list(map(int, prompt)), list(map(int, answer)))
                    for prompt, answer in json.loads(path.read_text())]
            if progress:
                print(f"rag-spec: the model's {len(kept)} answers, kept from an earlier run "
                      f"({path})", file=sys.stderr)
            return kept
        except (ValueError, TypeError) as err:  # unreadable: answered again below
            print(f"rag-spec: the model's answers kept in {path} could not be read "
                  f"({type(err).__name__}); answering again.", file=sys.stderr)
    partial = PartialAnswers(path.with_name(f"{digest}.partial.json"))
    answered = own_answers(model, tokenizer, passages, count, progress=progress,
                           partial=partial, **asked)
    with atomic_file(path) as scratch:
        scratch.write_text(json.dumps(answered))
    partial.path.unlink(missing_ok=True)
    return answered


def written_questions(decoder: Any, count: int, *, seed: int = 0, attempts: int = 3,
                      max_new_tokens: int = 48, progress: bool = False,
                      partial: PartialAnswers | None = None) -> list[str]:
    """Up to ``count`` questions the model writes when its chat template opens a user turn
    (sampled, seeded per batch; only those it ends itself are kept, in at most ``attempts``
    times the batches ``count`` needs). None without a chat template. With ``partial``, each
    batch's questions are kept there and a stopped run's taken up after its last batch."""
    opening = user_turn_opening(decoder.tokenizer)
    if opening is None or count <= 0:
        return []
    ids = decoder.tokenizer(opening, add_special_tokens=False)["input_ids"]
    questions, done = partial.questions() if partial is not None else ([], 0)
    batches = attempts * -(-count // _BATCH)
    for batch in progress_bar(range(done, batches), f"the model writing {count} questions",
                              "batch", enabled=progress and len(questions) < count):
        if len(questions) >= count:
            break
        rows = decoder.generate([ids] * _BATCH, max_new_tokens=max_new_tokens, do_sample=True,
                                temperature=1.0, top_p=0.95, seed=seed + batch * _BATCH)
        questions += [text for r in rows if r.finish_reason == "eos"
                      and (text := r.text.strip())]
        if partial is not None:
            partial.save_questions(questions, batch + 1)
    return questions[:count]


def user_turn_opening(tokenizer: Any) -> str | None:
    """The text a chat template puts before a user's message (its system prompt included), or
    None when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    return text[:text.index(_MARK)] if _MARK in text else None
