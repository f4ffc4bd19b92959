"""``python -m lab.head_agreement [HEAD.safetensors ...]``: how often a draft head's guesses are
the model's own next tokens in the benchmark's answers.

The model answers the lookahead bench's RAG and open-ended prompts and the held-out ones
(``lab.tree_replay``'s), greedily; then each head reads every answer teacher-forced, from the
model's own states: its first guess (the token after next, as it drafts one pass deep) and its
second (fed its own guessed state). Agreement on the answers a user gets, where a head's
metadata measures its held-out training positions (passages, prompts and answers mixed).
Beside each, ``in_subset``: the share of those answer tokens among the head's scored tokens
(its subset), the most its first guess could get right. Without arguments, the shipped head.
Environment: ``HA_N`` new tokens (default 128), ``HA_JSON`` the report's file (default
lab/results/head_agreement.json).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from lab import RESULTS


def main(paths: list[str]) -> None:
    from rag_spec import LookaheadDecoder
    from rag_spec.bench.lookahead import prompt_sets
    from rag_spec.bench.prompts import HELD_OUT_OPEN_PROMPTS, HELD_OUT_RAG_QUESTIONS, RAG_QUESTIONS
    from rag_spec.bench.report import machine
    from rag_spec.drafters.draft_head import SHIPPED, load_head, model_fingerprint
    from rag_spec.drafters.trie_drafter import TrieDrafter
    from rag_spec.models import load_model

    n = int(os.environ.get("HA_N", 128))
    lm = load_model("smollm2-135m-instruct")
    heads = [Path(p) for p in paths] or [SHIPPED / f"{model_fingerprint(lm.model)}.safetensors"]
    rag, open_ended = prompt_sets(lm.tokenizer, RAG_QUESTIONS[:8], 8)
    held_rag, held_open = prompt_sets(lm.tokenizer, HELD_OUT_RAG_QUESTIONS[:8], 8,
                                      HELD_OUT_OPEN_PROMPTS)
    decoder = LookaheadDecoder(lm.model, lm.tokenizer, drafter=TrieDrafter())
    sets = {"rag": rag, "open_ended": open_ended, "held_out_rag": held_rag,
            "held_out_open_ended": held_open}
    read = {name: [_states(lm.model, prompt, decoder.generate(prompt, max_new_tokens=n)
                           .token_ids) for prompt in prompts] for name, prompts in sets.items()}
    table = lm.model.get_input_embeddings().weight.detach().float()
    report: dict[str, Any] = {"benchmark": "head_agreement", "model": "smollm2-135m-instruct",
                              "machine": machine(), "max_new_tokens": n, "heads": {}}
    for path in heads:
        head = load_head(lm.model, path).float()
        report["heads"][str(path)] = {name: _agreement(head, table, rows)
                                      for name, rows in read.items()}
        print(path, report["heads"][str(path)], flush=True)
    out = Path(os.environ.get("HA_JSON", str(RESULTS / "head_agreement.json")))
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


@torch.no_grad()
def _states(model: Any, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, ...]:
    """The prompt and answer's tokens, the model's last states over them, and where the answer
    starts."""
    ids = torch.tensor(list(prompt) + list(answer))
    hidden = model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]
    return ids, hidden.float(), torch.tensor(len(prompt))


@torch.no_grad()
def _agreement(head: Any, table: torch.Tensor, rows: list[tuple[torch.Tensor, ...]]
               ) -> dict[str, float]:
    """Over every answer token a guess reaches: the share the head's first guess (``top1``)
    and its guess a token further (``top1_depth2``) got right, and the share it scores at all
    (``in_subset``)."""
    hits, totals, scored = [0, 0], [0, 0], 0
    for ids, hidden, start in rows:
        first = head.advance(hidden[:-1], table[ids[1:]])  # first[i] guesses ids[i + 2]
        second = head.advance(first[:-1], table[ids[2:]])  # second[i] guesses ids[i + 3]
        for depth, state in enumerate((first, second)):
            guess = head.subset[head.lm_head.readout(state).argmax(-1)]
            lead = depth + 2
            # answer tokens after the first (the first is the prefill's, never drafted)
            at = torch.arange(int(start) + 1, len(ids))
            at = at[at - lead >= int(start) - 1]
            hits[depth] += int((guess[at - lead] == ids[at]).sum())
            totals[depth] += len(at)
            if depth == 0:
                scored += int(torch.isin(ids[at], head.subset).sum())
    return {"top1": round(hits[0] / totals[0], 3), "top1_depth2": round(hits[1] / totals[1], 3),
            "in_subset": round(scored / totals[0], 3)}


if __name__ == "__main__":
    main(sys.argv[1:])
