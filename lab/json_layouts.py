"""``python -m lab.json_layouts``: which JSON layout the embedded model closes, on two
schemas: one of a boolean and a digit (``{"ok": ..., "n": 0..9}``: the layout must not cost
it its quick close) and one of two free strings (LangChain's standard tests' joke, where
compact JSON made the model write strings it never closed). Greedy, the default decoder,
each layout's answers closed and their lengths (lab/results/json_layouts.json)."""

from __future__ import annotations

FLAGS = {"type": "object", "required": ["ok", "n"],
         "properties": {"ok": {"type": "boolean"},
                        "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
JOKE = {"type": "object", "required": ["setup", "punchline"],
        "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}}}
PROMPTS = {
    "flags": (FLAGS, 64, ["Is 3 odd? Answer as JSON with ok and n=3.",
                          "Is the sky green? JSON please.", "Count to 5 and say if it is done.",
                          "Is Python a language? n is 7."]),
    "joke": (JOKE, 160, ["Tell me a joke about cats", "Tell me a joke about dogs",
                         "Tell me a joke about the sea", "Tell me a joke about programmers"]),
}


def main() -> None:
    import rag_spec
    from lab import write_result
    from rag_spec import JsonSchema

    lm = rag_spec.load_model()
    decoder = rag_spec.LookaheadDecoder(lm.model, lm.tokenizer)
    report: dict = {"model": lm.name, "layouts": {}}
    for whitespace in (0, 1):
        layout = report["layouts"][f"whitespace={whitespace}"] = {}
        for name, (schema, limit, prompts) in PROMPTS.items():
            rows = []
            for prompt in prompts:
                ids = rag_spec.chat_input_ids(lm.tokenizer, [{"role": "user", "content": prompt}])
                result = decoder.generate(ids, max_new_tokens=limit,
                                          json_schema=JsonSchema(schema, whitespace=whitespace))
                rows.append({"closed": not result.incomplete, "tokens": len(result.token_ids),
                             "text": result.text})
            layout[name] = {"closed": sum(r["closed"] for r in rows), "of": len(rows),
                            "tokens": [r["tokens"] for r in rows], "answers": rows}
            print(f"whitespace={whitespace} {name}: closed {layout[name]['closed']}/"
                  f"{len(rows)}, tokens {layout[name]['tokens']}")
    write_result(report, "json_layouts")


if __name__ == "__main__":
    main()
