"""The lab: benches that measure rag-spec itself rather than a user's model (a step against
the memory-bandwidth floor, the GPU check), kept outside the wheel. Run them from the
repository root: ``python -m lab.floor``, ``make gpu-check``. They write their JSON into
``lab/results/`` (``RESULTS``), never into docs/: what they found goes into docs/concepts.md as
sentences ("Why the defaults")."""

import json
from pathlib import Path

RESULTS = Path("lab/results")


def write_result(report: dict, name: str) -> Path:
    """``report`` as lab/results/NAME.json; says where it went."""
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def held_out_prompts(lm: object, rag: int, open_ended: int) -> dict[str, list[list[int]]]:
    """Chat prompts of the first held-out RAG questions (each with its top-3 passages from the
    default knowledge base) and open-ended prompts, as ``lm``'s tokenizer writes them."""
    import rag_spec
    from rag_spec.bench.prompts import HELD_OUT_OPEN_PROMPTS, HELD_OUT_RAG_QUESTIONS

    tokenizer = lm.tokenizer  # type: ignore[attr-defined]
    questions = list(HELD_OUT_RAG_QUESTIONS[:rag])
    hits = rag_spec.KnowledgeBase.load_default().search(questions, k=3) if questions else []
    return {"rag": [rag_spec.chat_input_ids(tokenizer, rag_spec.rag_messages(q, h))
                    for q, h in zip(questions, hits)],
            "open_ended": [rag_spec.chat_input_ids(tokenizer, [{"role": "user", "content": p}])
                           for p in HELD_OUT_OPEN_PROMPTS[:open_ended]]}
