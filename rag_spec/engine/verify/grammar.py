"""Output that must follow a grammar (a JSON schema, a regex, EBNF, a list of choices), on
xgrammar, the engine vLLM and SGLang use.

A row's ``Constraint`` is xgrammar's matcher after the row's committed tokens. Around each
speculative step it does three things, so that the output is exactly constrained decoding's:

- ``drafts``: a draft token the grammar forbids after its path is cut with its subtree before
  the forward pass pays for it, and the text the grammar forces next (jump-forward decoding)
  joins the tree as a chain, first, to be verified like any draft;
- ``masks``: after the pass, the target's logits at the root and at every node are masked with
  the grammar's state along that node's path, so verification picks what constrained decoding
  would pick there (greedy: the argmax of masked logits; sampling: the masked distribution);
- ``advance``: the committed tokens move the matcher on.

Cutting a draft is exact wherever verification would reject it with certainty: always under
greedy decoding and for drafts without probabilities (sample-and-match). A sampled tree that
carries ``draft_probs`` keeps its nodes: masked target probabilities reject a forbidden one,
and the residual distribution is updated as multi-step speculative sampling requires.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rag_spec.errors import RagSpecError
from rag_spec.target.tree import TokenTree


@dataclass(frozen=True)
class JsonSchema:
    """A JSON schema and the layout of the JSON that follows it.

    By default (``whitespace=1``) at most one whitespace character stands at each place JSON
    allows some: a grammar that allows any lets a small model spend its
    tokens on newlines and never close the object, and one that allows none (compact JSON,
    ``whitespace=0``: one space after ``,`` and ``:``, as ``json.dumps`` writes it) makes
    some schemas' free strings run on, where the model would have closed them after a
    newline it may not write. ``indent=2`` lays the JSON out over fixed lines instead.
    ``GenerationResult.incomplete`` says when an answer did not close.

    Examples:
        >>> decoder.generate(ids, json_schema=JsonSchema(Answer, indent=2))  # doctest: +SKIP
    """

    schema: Any  # a dict, a JSON string or a Pydantic model class
    indent: int | None = None
    whitespace: int = 1  # free whitespace characters a place, where ``indent`` is None

    def compile_arguments(self) -> dict[str, Any]:
        """xgrammar's ``compile_json_schema`` layout arguments for this layout."""
        if self.indent is not None or self.whitespace == 0:
            return {"any_whitespace": False, "indent": self.indent}
        return {"any_whitespace": True, "max_whitespace_cnt": self.whitespace}


@dataclass(frozen=True)
class GrammarRequest:
    """What one row's output must follow: exactly one of the four."""

    json_schema: Any = None  # a dict, a JSON string, a Pydantic model class or a JsonSchema
    regex: str | None = None
    grammar: str | None = None  # EBNF (GBNF), its start rule ``root``
    choices: Sequence[str] | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.json_schema, self.regex, self.grammar,
                                           self.choices))


def row_requests(rows: int, **kinds: Any) -> list[GrammarRequest]:
    """One GrammarRequest per row from ``generate``'s keywords: a list gives one per row (None:
    that row is free; for ``choices``, a list of lists), anything else applies to every row."""
    columns = {name: _per_row(name, value, rows) for name, value in kinds.items()}
    requests = [GrammarRequest(**{name: column[b] for name, column in columns.items()})
                for b in range(rows)]
    for request in requests:
        given = [name for name in kinds if getattr(request, name) is not None]
        if len(given) > 1:
            msg = (f"Give one of json_schema, regex, grammar or choices per prompt (got "
                   f"{', '.join(given)}); a JSON schema can hold choices (enum) itself.")
            raise RagSpecError(msg)
    return requests


def _per_row(name: str, value: Any, rows: int) -> list[Any]:
    if name == "choices":
        listed = isinstance(value, list) and any(v is None or isinstance(v, (list, tuple))
                                                 for v in value)
    else:
        listed = isinstance(value, list)
    if not listed:
        return [value] * rows
    if len(value) != rows:
        msg = f"{name} has {len(value)} entries for {rows} prompts; give one per prompt."
        raise RagSpecError(msg)
    return list(value)


_CACHE_BYTES = 256 * 2**20  # compiled grammars kept per tokenizer


class Grammars:
    """The compiler for one tokenizer (xgrammar's tokenizer info takes a second to build, and
    its compiler caches what it compiled), shared by every decoder on that tokenizer."""

    _by_tokenizer: weakref.WeakKeyDictionary[Any, Grammars] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_ids) or None)
        except Exception as err:  # what xgrammar raises depends on the tokenizer's kind
            msg = (f"The grammar engine (xgrammar) cannot read this tokenizer "
                   f"({type(err).__name__}: {str(err)[:200]}); constrained output needs a "
                   f"Hugging Face tokenizer (tokenizer.json or a sentencepiece model).")
            raise RagSpecError(msg) from err
        self.vocab_size = vocab_size
        # xgrammar's compiler caches what it compiled; bounded for a long-running service
        self.compiler = xgr.GrammarCompiler(info, cache_limit_bytes=_CACHE_BYTES)

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> Grammars:
        with cls._lock:
            grammars = cls._by_tokenizer.get(tokenizer)
            if grammars is None or grammars.vocab_size != vocab_size:
                grammars = cls._by_tokenizer[tokenizer] = cls(tokenizer, vocab_size, stop_ids)
            return grammars

    def compile(self, request: GrammarRequest) -> Any:
        """xgrammar's compiled grammar for ``request``; a RagSpecError that names the fix for
        anything that does not compile, before any decoding."""
        kind, text = _source(request)
        try:
            if kind == "json_schema":
                layout = request.json_schema if isinstance(request.json_schema, JsonSchema) \
                    else JsonSchema(None)
                return self.compiler.compile_json_schema(text, **layout.compile_arguments())
            if kind == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(text)
        except Exception as err:  # xgrammar raises RuntimeError / ValueError subclasses
            fixes = {"json_schema": "give a JSON schema (a dict, a JSON string or a Pydantic "
                                    "model class) that xgrammar supports",
                     "regex": "give a regular expression xgrammar supports (no lookaround or "
                              "backreferences)",
                     "grammar": "give an EBNF grammar whose start rule is root, e.g. "
                                "root ::= \"yes\" | \"no\"",
                     "choices": "give non-empty strings"}
            msg = (f"The {kind.replace('_', ' ')} does not compile "
                   f"({type(err).__name__}: {str(err).strip()[:300]}); {fixes[kind]}.")
            raise RagSpecError(msg) from err


def _source(request: GrammarRequest) -> tuple[str, str]:
    """(kind, text) of a request, the text in xgrammar's input form."""
    if request.json_schema is not None:
        schema = request.json_schema
        if isinstance(schema, JsonSchema):
            schema = schema.schema
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, dict):
            schema = json.dumps(schema)
        if not isinstance(schema, str):
            msg = (f"json_schema takes a dict, a JSON string or a Pydantic model class (got "
                   f"{type(schema).__name__}).")
            raise RagSpecError(msg)
        return "json_schema", schema
    if request.regex is not None:
        return "regex", str(request.regex)
    if request.grammar is not None:
        return "grammar", str(request.grammar)
    if isinstance(request.choices, str):  # not a sequence of its letters
        msg = (f"choices takes a list of strings (got the string {request.choices!r}); for "
               f"one fixed answer give choices=[{request.choices!r}].")
        raise RagSpecError(msg)
    choices = list(request.choices or [])
    if not choices or not all(isinstance(c, str) and c for c in choices):
        msg = f"choices takes a list of non-empty strings (got {request.choices!r})."
        raise RagSpecError(msg)
    literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return "choices", f"root ::= {literals}"


class Constraint:
    """One row's grammar state: the matcher after the row's committed tokens."""

    def __init__(self, compiled: Any, vocab_size: int, tokenizer: Any) -> None:
        xgr = _xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        # ids no grammar takes (special tokens, padded rows): refused here, not by a matcher
        # that logs a warning for each (drafts copy them from the prompt)
        self._never = frozenset(compiled.tokenizer_info.special_token_ids)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self._xgr = xgr

    def drafts(self, tree: TokenTree, budget: int) -> TokenTree:
        """``tree`` without the nodes the grammar forbids (kept where they carry draft
        probabilities: verification rejects them exactly), and the forced continuation as
        a chain, first, within ``budget`` nodes."""
        if tree.draft_probs is None:
            tree = self._allowed(tree)
        forced = self._forced()
        if not len(forced):
            return tree
        if tree.draft_probs is not None:
            return tree.merged(forced, max(budget, len(tree)))
        return forced.merged(tree, max(budget, len(forced)))

    def masks(self, tree: TokenTree) -> torch.Tensor:
        """[1 + n, words] xgrammar's bitmask of the tokens allowed at the root and after each
        node of ``tree`` (whose nodes the grammar allows, unless they carry probabilities:
        then a forbidden node's own row allows everything, as verification never keeps it)."""
        bitmask = self._xgr.allocate_token_bitmask(1 + len(tree), self.vocab_size)
        children = _children(tree)

        def visit(node: int) -> None:
            if self.matcher.is_terminated():  # the node is the stop token: nothing follows
                return
            self.matcher.fill_next_token_bitmask(bitmask, node + 1)
            for child in children[node]:
                if self._takes(tree.tokens[child]):
                    visit(child)
                    self.matcher.rollback(1)

        visit(-1)
        return bitmask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """``logits`` [1 + n, vocab] with what the grammar forbids at each row set to -inf
        (``bitmask``: ``masks`` of the tree the logits verify)."""
        masked = logits.float().clone()
        vocab = min(masked.shape[-1], self.vocab_size)
        self._xgr.apply_token_bitmask_inplace(masked[:, :vocab], bitmask.to(masked.device),
                                              vocab_size=vocab)
        if masked.shape[-1] > vocab:  # padded embedding rows: never a token
            masked[:, vocab:] = float("-inf")
        if torch.isneginf(masked[0]).all():
            msg = ("The grammar allows no token of this tokenizer here: it cannot spell what "
                   "the grammar requires next (a JSON schema needs braces and quotes). Use a "
                   "grammar this vocabulary can produce.")
            raise RagSpecError(msg)
        return masked

    @property
    def complete(self) -> bool:
        """Whether the committed tokens form a whole string of the grammar (a JSON object
        closed): an answer cut short of that is not valid under it."""
        return self.matcher.is_terminated() or self.matcher.is_completed()

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` (what verification kept, each one allowed by construction)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(token)):
                msg = (f"Token {token} broke the grammar: constrained verification kept a "
                       f"token its mask forbade. Please report this.")
                raise RuntimeError(msg)

    def _takes(self, token: int) -> bool:
        """Whether the matcher takes ``token`` next (it does: roll it back after)."""
        return token not in self._never and self.matcher.accept_token(token)

    def _allowed(self, tree: TokenTree) -> TokenTree:
        """The nodes whose token the grammar accepts after their path, with their parents."""
        children = _children(tree)
        kept: list[int] = []

        def visit(node: int) -> None:
            if self.matcher.is_terminated():
                return
            for child in children[node]:
                if self._takes(tree.tokens[child]):
                    kept.append(child)
                    visit(child)
                    self.matcher.rollback(1)

        visit(-1)
        if len(kept) == len(tree):
            return tree
        kept.sort()
        index = {old: new for new, old in enumerate(kept)}
        return TokenTree(tuple(tree.tokens[i] for i in kept),
                         tuple(-1 if tree.parents[i] < 0 else index[tree.parents[i]]
                               for i in kept))

    def _forced(self) -> TokenTree:
        """The text the grammar forces next, tokenised, as far as the grammar accepts it."""
        if self.matcher.is_terminated():
            return TokenTree.empty()
        text = self.matcher.find_jump_forward_string()
        if not text:
            return TokenTree.empty()
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        accepted = 0
        for token in ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return TokenTree.from_paths([ids[:accepted]]) if accepted else TokenTree.empty()


def _children(tree: TokenTree) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {i: [] for i in range(-1, len(tree))}
    for node, parent in enumerate(tree.parents):
        children[parent].append(node)
    return children


@functools.cache
def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:
        msg = (f"Constrained output (json_schema, regex, grammar, choices) needs xgrammar "
               f"({err}); install it with: pip install xgrammar.")
        raise RagSpecError(msg) from err
    return xgrammar
