"""Why langchain-tests' ``test_agent_loop`` fails on the embedded 135M model: under
``tool_choice="auto"`` whether to call a tool is the model's own choice, and greedy decoding
(what rag-spec must reproduce) takes its most likely first token. This measures, on weather
questions like the test's, the probability the model gives the call's opening (``<tool_call>``,
teacher-forced) at the answer's start, and the rank of its first token, against the model's
top choice. Writes lab/results/agent_call_ceiling.json. ``python -m lab.agent_call_ceiling``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lab import write_result
from rag_spec.bench.report import command_line, machine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather at a location.",
    "parameters": {"type": "object", "required": ["location"],
                   "properties": {"location": {"type": "string"}}}}}
QUESTIONS = ("What is the weather in San Francisco, CA?", "What's the weather like in Paris?",
             "Tell me the weather in Tokyo.", "Is it raining in London right now?")


def main() -> dict[str, Any]:
    from rag_spec import GenerateOptions, LocalLM, tool_options

    lm = LocalLM.shared("smollm2-135m-instruct")
    model, tokenizer = lm.lm.model, lm.lm.tokenizer
    opening = tokenizer(lm.call_format.trigger, add_special_tokens=False).input_ids
    rows = []
    for question in QUESTIONS:
        options = GenerateOptions(max_new_tokens=8, **tool_options([WEATHER], "auto"))
        ids = lm.encode([{"role": "user", "content": question}], options.tools)
        with torch.inference_mode():
            logits = model(torch.tensor([ids + opening])).logits[0].float()
        log_p = torch.log_softmax(logits, -1)
        at = len(ids) - 1
        call = sum(float(log_p[at + i, t]) for i, t in enumerate(opening))
        top = int(log_p[at].argmax())
        rows.append({"question": question, "p_call_opening": float(f"{math.exp(call):.3g}"),
                     "rank_of_its_first_token": int((log_p[at] > log_p[at, opening[0]]).sum()),
                     "top_token": tokenizer.decode([top]),
                     "p_top_token": round(float(log_p[at, top].exp()), 3)})
        print(rows[-1])
    report = {"benchmark": "agent_call_ceiling", "command": command_line(), "machine": machine(),
              "model": lm.name, "call_opening": lm.call_format.trigger, "questions": rows}
    write_result(report, "agent_call_ceiling")
    return report


if __name__ == "__main__":
    main()
