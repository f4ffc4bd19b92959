"""``make gpu-check``: the engine on an accelerator, with random weights of a realistic shape.

Machines with a GPU here reach no model hub, so the check builds a Llama of Llama-3-8B's shape
(fewer layers by default, to fit a short lease) with random weights in bf16, and reports:

- greedy identity with transformers ``generate`` for the trie (also with exact numerics), a
  draft model (the target's first layers, saved as a model of its own), the early-exit draft,
  a draft head (untrained) and the merged drafter over each model, at batch 1 and 4;
- multi-step speculative sampling against plain sampling on the first token (total variation
  distance between the two empirical distributions, with the bound that sampling noise allows);
  sampling with every drafter and knob, batched, reproducible from its seed;
- an exit adapter and a draft head trained on the device, and greedy identity through each;
- speed: greedy tokens per second beside ``generate``, its prompt lookup and assisted
  generation, and our no-drafts ablation; the same for compiled steps (CUDA graphs), ours
  beside transformers' compiled generation;
- step costs: transformers' one-token step, and ours over 1, 8, 16 and 32 tokens (also with
  exact numerics) at a long context;
- a compiled step (``torch.compile`` over a static cache) against our eager one, 1 to 17 tokens
  wide, at that context, with its logits' error against the model's own;
- constrained decoding (xgrammar, a JSON schema over a character tokenizer built here): greedy
  identity with ``generate`` + xgrammar's logits processor, and what the grammar adds to a
  step without drafts and with a 16-node tree (its masks are filled while the pass runs);
  skipped, saying how, where xgrammar is not installed (its wheel travels in the tree);
- the tree-attention kernel (Triton) against its torch reference, transformers' attention (KV
  heads repeated, a dense mask) and torch's flex attention (with its block mask) at batch 16
  and a long context, chains of 1 to 8 tokens and a StreamingLLM selection; and
  self-speculation's steps at that batch: a one-token step, a 4-token verification, a draft
  pass through the sparse view.

Random weights make near ties rarer than a trained model's; peaked logits (a large
initializer) keep greedy decoding stable under bf16. Run ``python -m lab.gpu_check
--tiny`` anywhere (the tests do, on the CPU) to check the script itself; ``--only`` runs some
sections. A section that fails leaves its traceback in the report, the others still run, and
the check exits non-zero.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from rag_spec.bench.report import (
    figure,
    machine,
    pass_statistics,
    runs_pass_statistics,
    save_figure,
)

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0}
SECTIONS = ("greedy_identical", "sampling", "sampled_drafters", "trained_exit", "trained_head",
            "speed", "compiled_speed", "step_ms", "compiled_step", "structured",
            "attention_kernel", "long_context_batch")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 96}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the script)")
    parser.add_argument("--layers", type=int, default=8, help="target layers (8B has 32)")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=2048, help="context of the step costs")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="these sections alone")
    parser.add_argument("--model", help="a saved model's directory (save_pretrained) to run "
                                        "instead of random weights: acceptance then means "
                                        "something")
    parser.add_argument("--prompts", help="a JSON list of token-id prompts for the speed "
                                          "sections (the first warms up)")
    parser.add_argument("--replot", metavar="JSON", help="draw a saved report's PNG, and stop")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return {}
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        target = _saved_model(args.model, device, dtype)
    else:
        target = _random_llama(TINY if args.tiny else LLAMA3_8B, args.layers, device, dtype)
    vocab = target.config.vocab_size
    race = json.loads(Path(args.prompts).read_text()) if args.prompts else _prompts(vocab, 7)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                              else "cpu", "dtype": str(dtype),
                              "layers": target.config.num_hidden_layers,
                              "shape": args.model or ("tiny" if args.tiny else "Llama-3-8B"),
                              "machine": machine()}
    sections = {
        "greedy_identical": lambda: _greedy(target, args.draft_layers, 24 if args.tiny else 64),
        "sampling": lambda: _sampling(target, args.draft_layers, 400 if args.tiny else 2000),
        "sampled_drafters": lambda: _sampled_drafters(target, args.draft_layers),
        "trained_exit": lambda: _trained_exit(target, args.draft_layers),
        "trained_head": lambda: _trained_head(target),
        "speed": lambda: _speed(target, args.draft_layers, race, 24 if args.tiny else 128),
        "compiled_speed": lambda: _compiled_speed(target, race, 24 if args.tiny else 128),
        "step_ms": lambda: _step_costs(target, 64 if args.tiny else args.context),
        "compiled_step": lambda: _compiled_step(target, 64 if args.tiny else args.context),
        "structured": lambda: _structured(target, 24 if args.tiny else 64),
        "attention_kernel": lambda: _attention_kernel(target, 16, 64 if args.tiny else 4096),
        "long_context_batch": lambda: _long_batch(target, 4 if args.tiny else 16,
                                                  64 if args.tiny else args.context)}
    failed = []
    seconds = report["seconds"] = {}
    for name in args.only or sections:
        started = time.perf_counter()
        try:
            report[name] = sections[name]()
        except Exception:  # the other sections still run: a lease is short
            report[name] = {"error": traceback.format_exc()}
            failed.append(name)
        seconds[name] = round(time.perf_counter() - started, 1)  # to plan the next lease
        print(name, f"({seconds[name]} s)", json.dumps(report[name], indent=2), flush=True)
        if args.json:  # after each section: a lease that ends mid-check keeps the rest
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        plot(report, Path(args.json).with_suffix(".png"))
    if failed:
        message = f"gpu-check: {', '.join(failed)} failed (tracebacks in the report)"
        raise SystemExit(message)
    return report


def _random_llama(shape: dict[str, Any], layers: int, device: torch.device,
                  dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=8192,
                         initializer_range=0.05 if shape is LLAMA3_8B else 0.3,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _saved_model(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def _first_layers(model: Any, count: int) -> Any:
    from transformers import LlamaForCausalLM

    config = type(model.config).from_dict(model.config.to_dict())
    config.num_hidden_layers = count
    with torch.device(model.device):
        draft = LlamaForCausalLM(config).to(model.dtype).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    draft.generation_config.eos_token_id = None
    return draft


def _drafters(target: Any, draft: Any, draft_layers: int) -> dict[str, Any]:
    """Each drafter by name (the trie: None), ``draft`` being the target's first layers and the
    draft head an untrained one over the first 8,192 token ids."""
    from rag_spec.drafters.draft_head import DraftHead
    from rag_spec.drafters.feature_drafter import FeatureDrafter
    from rag_spec.drafters.merged_drafter import MergedDrafter
    from rag_spec.drafters.model_drafter import DraftModelDrafter, EarlyExitDrafter
    from rag_spec.drafters.self_drafter import SelfSpecDrafter

    head = DraftHead(target, torch.arange(min(8192, target.config.vocab_size)))
    return {"trie": None, "draft_model": DraftModelDrafter(draft),
            "early_exit": EarlyExitDrafter(draft_layers),
            "merged": MergedDrafter(DraftModelDrafter(draft)),
            "draft_head": FeatureDrafter(head),
            "merged_head": MergedDrafter(FeatureDrafter(head)),
            # a view smaller than the prompts (48 tokens): the sparse path drafts
            "self_spec": SelfSpecDrafter(budget=24, sinks=4, probe_every=1)}


def _prompts(vocab: int, count: int, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = []
    for _ in range(count):
        phrase = torch.randint(3, vocab, (12,), generator=g).tolist()
        prompts.append((phrase * (length // 12 + 1))[:length])  # repeats: the trie drafts
    return prompts


def _hf_greedy(target: Any, prompt: list[int], new_tokens: int, **kwargs: Any) -> list[int]:
    """transformers' greedy tokens after ``prompt`` (``kwargs``: its speculation options)."""
    ids = torch.tensor([prompt], device=target.device)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=new_tokens, **kwargs)
    return out[0, len(prompt):].tolist()


def _greedy(target: Any, draft_layers: int, new_tokens: int) -> dict[str, Any]:
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder

    prompts = _prompts(target.config.vocab_size, 4)
    expected = [_hf_greedy(target, p, new_tokens) for p in prompts]
    decoders = {name: LookaheadDecoder(target, drafter=drafter)
                for name, drafter in _drafters(target, _first_layers(target, draft_layers),
                                               draft_layers).items()}
    # exact numerics (per-token attention, row-invariant products; bf16's default), and the
    # fast kernels, whose rounding differs from a one-token step's
    for name, exact in (("trie_exact", True), ("trie_fast", False)):
        decoders[name] = LookaheadDecoder(target, config=LookaheadConfig(exact=exact))
    results = {}
    for name, decoder in decoders.items():
        alone = [decoder.generate(p, new_tokens) for p in prompts]
        batch = decoder.generate(prompts, new_tokens)
        results[name] = {
            "batch1": sum(r.token_ids == e for r, e in zip(alone, expected)),
            "batch4": sum(r.token_ids == e for r, e in zip(batch, expected)),
            "of": len(prompts),
            **pass_statistics([r.stats for r in alone])}
    return results


def _sampling(target: Any, draft_layers: int, samples: int) -> dict[str, Any]:
    """First-token distribution of speculative sampling vs the exact one, as total variation."""
    from rag_spec.drafters.model_drafter import DraftModelDrafter
    from rag_spec.engine.decoder import LookaheadDecoder

    prompt = _prompts(target.config.vocab_size, 1)[0]
    with torch.inference_mode():
        logits = target(torch.tensor([prompt], device=target.device)).logits[0, -1].float()
    exact = torch.softmax(logits / 0.8, -1).cpu()
    decoder = LookaheadDecoder(target, drafter=DraftModelDrafter(_first_layers(target,
                                                                             draft_layers)))
    got = torch.zeros_like(exact)
    accepted = 0
    for start in range(0, samples, 100):
        rows = decoder.generate([prompt] * min(100, samples - start), 2, do_sample=True,
                                temperature=0.8, seed=start)
        for r in rows:
            got[r.token_ids[0]] += 1
            accepted += sum(r.stats.accepted_per_step)
    tv = 0.5 * float((got / samples - exact).abs().sum())
    support = int((exact > 1e-4).sum())
    return {"samples": samples, "total_variation": round(tv, 4),
            # the expected TV of an exact sampler is about sqrt(support / (2 pi n))
            "noise_level": round((support / (2 * torch.pi * samples)) ** 0.5, 4),
            "accepted_draft_tokens": accepted}


def _sampled_drafters(target: Any, draft_layers: int) -> dict[str, Any]:
    """Sampling with every drafter and every knob (temperature, top-p, top-k, repetition
    penalty), batched: each row's tokens, drawn twice with the same seed by drafters in the same
    state (fresh ones: a trie learns from earlier outputs), must be the same."""
    from rag_spec.engine.decoder import LookaheadDecoder

    prompts = _prompts(target.config.vocab_size, 3)
    knobs = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 50,
             "repetition_penalty": 1.1, "seed": 7}
    draft = _first_layers(target, draft_layers)
    report = {}
    for name in _drafters(target, draft, draft_layers):
        first, second = (LookaheadDecoder(target,
                                          drafter=_drafters(target, draft, draft_layers)[name])
                         .generate(prompts, 24, **knobs) for _ in range(2))
        report[name] = {"reproducible": sum(a.token_ids == b.token_ids
                                            for a, b in zip(first, second)),
                        "of": len(prompts),
                        "tokens": sum(len(r.token_ids) for r in first),
                        "accepted_draft_tokens": sum(sum(r.stats.accepted_per_step)
                                                     for r in first)}
    return report


def _trained_exit(target: Any, layers: int) -> dict[str, Any]:
    """Train an exit adapter briefly on the model's device, then decode through it: greedy
    tokens equal ``generate``'s whatever the adapter learnt."""
    from rag_spec.drafters.model_drafter import EarlyExitDrafter
    from rag_spec.training.train_exit import train_exit

    vocab = target.config.vocab_size
    adapter = train_exit(target, layers, _prompts(vocab, 12, length=36),
                         vocabulary=min(512, vocab), epochs=1, progress=False)
    return _trained(target, EarlyExitDrafter(layers, adapter=adapter), adapter.agreement)


def _trained_head(target: Any) -> dict[str, Any]:
    """``_trained_exit`` for a draft head (``FeatureDrafter``), alone and merged with the
    trie."""
    from rag_spec.drafters.feature_drafter import FeatureDrafter
    from rag_spec.drafters.merged_drafter import MergedDrafter
    from rag_spec.training.train_head import train_head

    vocab = target.config.vocab_size
    head = train_head(target, _prompts(vocab, 12, length=36), vocabulary=min(512, vocab),
                      epochs=1, progress=False)
    report = _trained(target, FeatureDrafter(head), head.agreement)
    report["merged"] = _trained(target, MergedDrafter(FeatureDrafter(head)), None)
    return report


def _trained(target: Any, drafter: Any, agreement: Any) -> dict[str, Any]:
    """Greedy identity with ``generate`` through a trained ``drafter``, on two prompts."""
    from rag_spec.engine.decoder import LookaheadDecoder

    decoder = LookaheadDecoder(target, drafter=drafter)
    prompts = _prompts(target.config.vocab_size, 2)
    identical = sum(decoder.generate(prompt, 32).token_ids == _hf_greedy(target, prompt, 32)
                    for prompt in prompts)
    return {"agreement": agreement, "identical_to_hf": identical, "of": len(prompts)}


def _speed(target: Any, draft_layers: int, prompts: list[list[int]], new_tokens: int
           ) -> dict[str, Any]:
    """Greedy decoding of ``prompts`` but the first (a warm-up), one at a time, systems
    interleaved: medians of per-prompt ratios to ``generate`` and to our no-drafts ablation
    (same kernels), beside the peers a user would pick instead (prompt lookup, assisted
    generation with the same draft); ours on the default kernels (exact numerics in half
    precision) and on the fast ones.
    Random weights make acceptance meaningless: read the ratios with tokens per step."""
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder

    draft = _first_layers(target, draft_layers)
    drafters = _drafters(target, draft, draft_layers)
    systems = {"hf": _hf_system(target, new_tokens),
               "hf_prompt_lookup": _hf_system(target, new_tokens, prompt_lookup_num_tokens=10),
               "hf_assisted": _hf_system(target, new_tokens, assistant_model=draft)}
    for suffix, exact in (("", "auto"), ("_fast", False)):  # default kernels, fast kernels
        systems[f"rag_spec_no_drafts{suffix}"] = _our_system(LookaheadDecoder(
            target, config=LookaheadConfig(budget=0, exact=exact)), new_tokens)
        systems[f"rag_spec_trie{suffix}"] = _our_system(LookaheadDecoder(
            target, config=LookaheadConfig(exact=exact)), new_tokens)
    for name in ("draft_model", "merged", "draft_head"):
        systems[f"rag_spec_{name}"] = _our_system(
            LookaheadDecoder(target, drafter=drafters[name]), new_tokens)
    return _race(systems, prompts, new_tokens)


def _compiled_speed(target: Any, prompts: list[list[int]], new_tokens: int
                    ) -> dict[str, Any]:
    """``_speed`` for compiled steps (CUDA graphs on a GPU): transformers' own compiled
    generation (a static cache) beside ``generate``, ours compiled beside ours on the fast
    kernels, each with drafts (the trie) and without. A compiled step fuses operations and
    rounds differently, so in half precision its tokens may part from eager ones."""
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder

    systems = {"hf": _hf_system(target, new_tokens),
               "hf_compiled": _hf_system(target, new_tokens, cache_implementation="static")}
    for suffix, compile in (("_fast", False), ("_compiled", True)):
        for name, budget in (("no_drafts", 0), ("trie", LookaheadConfig().budget)):
            config = LookaheadConfig(budget=budget, exact=False, compile=compile)
            systems[f"rag_spec_{name}{suffix}"] = _our_system(
                LookaheadDecoder(target, config=config), new_tokens)
    return _race(systems, prompts, new_tokens)


def _hf_system(target: Any, new_tokens: int, **kwargs: Any) -> Any:
    from rag_spec.bench.report import Run

    return lambda prompt: Run(0.0, _hf_greedy(target, prompt, new_tokens, **kwargs))


def _our_system(decoder: Any, new_tokens: int) -> Any:
    from rag_spec.bench.report import Run

    def generate(prompt: list[int]) -> Any:
        result = decoder.generate(prompt, new_tokens)
        return Run(0.0, result.token_ids, {"stats": [result.stats]})
    return generate


def _race(systems: dict[str, Any], prompts: list[list[int]], new_tokens: int
          ) -> dict[str, Any]:
    """Run ``systems`` over ``prompts`` (the first a warm-up), interleaved; per system its
    tokens per second, per-prompt ratios to ``hf`` and to our no-drafts ablation on the same
    kernels (the name's ``_fast`` / ``_compiled`` suffix), and identity with ``hf``."""
    from rag_spec.bench.report import interleaved, median

    # printed as they come, so a lease that ends mid-race still shows them
    for name, system in systems.items():  # warm-up: kernels chosen, step costs timed, compiled
        started = time.perf_counter()
        system(prompts[0])
        print(f"  warm-up {name}: {time.perf_counter() - started:.1f} s", flush=True)
    runs = interleaved(systems, prompts[1:], progress=lambda line: print(line, flush=True))

    def ratios(name: str, baseline: str) -> float:
        return round(median([b.seconds / r.seconds for b, r in zip(runs[baseline], runs[name])]),
                     3)

    report: dict[str, Any] = {"prompts": len(prompts) - 1, "new_tokens": new_tokens}
    for name, system_runs in runs.items():
        entry = {"tok_per_s": round(median([len(r.tokens) / r.seconds for r in system_runs]), 1),
                 "speedup_vs_hf": ratios(name, "hf"),
                 "identical_to_hf": sum(r.tokens == b.tokens
                                        for r, b in zip(system_runs, runs["hf"]))}
        if name.startswith("rag_spec"):  # against the ablation on the same kernels
            suffix = next((s for s in ("_fast", "_compiled") if name.endswith(s)), "")
            entry["speedup_vs_no_drafts"] = ratios(name, f"rag_spec_no_drafts{suffix}")
            entry.update(runs_pass_statistics(system_runs))
        report[name] = entry
    return report


def _step_costs(target: Any, context: int) -> dict[str, float]:
    """Milliseconds of transformers' one-token step and of ours 1 to 32 tokens wide (also with
    exact numerics), after a ``context``-token prefill."""
    from lab.floor import step_seconds

    prompt = torch.randint(3, target.config.vocab_size, (context,)).tolist()
    costs = step_seconds(target, prompt, (1, 8, 16, 32), repeats=5)
    return {name: round(1000 * seconds, 2) for name, seconds in costs.items()}


def _compiled_step(target: Any, context: int) -> dict[str, Any]:
    """A torch.compile'd step on a static cache against our eager one, 1 to 17 tokens wide,
    after a ``context``-token prefill (ratios, milliseconds, compile seconds, logit error)."""
    from lab.floor import compiled_over_eager

    prompt = torch.randint(3, target.config.vocab_size, (context,)).tolist()
    return compiled_over_eager(target, prompt, (1, 8, 17))


STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "n", "ok", "tags"]}


def _char_tokenizer() -> Any:
    """A character-level tokenizer of what JSON needs (ids 0-2 special), small enough for the
    tiny model's vocabulary: the grammar engine reads it as it reads any."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.digits + '{}[]":,. -\n'
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def _structured(target: Any, new_tokens: int) -> dict[str, Any]:
    """Constrained greedy decoding against ``generate`` with xgrammar's logits processor (the
    same grammar), and milliseconds per step with and without the grammar, interleaved, at no
    drafts and at a 16-node tree (the masks cover every node)."""
    try:
        import xgrammar as xgr
    except ImportError:
        return {"skipped": "needs xgrammar: here `pip download xgrammar --no-deps -d wheels`, "
                           "there `pip install --no-index wheels/xgrammar-*.whl`"}
    from rag_spec.bench.report import median
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder
    from rag_spec.engine.verify.grammar import GrammarRequest, Grammars

    tok = _char_tokenizer()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tok), (48,), generator=generator).tolist()
               for _ in range(4)]
    compiled = Grammars.of(tok, target.config.vocab_size, [2]).compile(
        GrammarRequest(json_schema=STRUCTURED_SCHEMA))
    report: dict[str, Any] = {"prompts": len(prompts) - 1, "new_tokens": new_tokens}
    expected = [_hf_greedy(target, p, new_tokens,
                           logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
                for p in prompts]
    expected = [e[:e.index(2) + 1] if 2 in e else e for e in expected]
    for budget in (0, 16):
        decoder = LookaheadDecoder(target, tok, LookaheadConfig(budget=budget))
        kinds = {"free": {}, "json_schema": {"json_schema": STRUCTURED_SCHEMA}}
        ms: dict[str, list[float]] = {kind: [] for kind in kinds}
        identical = 0
        for i, prompt in enumerate(prompts):  # the first warms up (the grammar compiles)
            for kind in (list(kinds) if i % 2 else list(kinds)[::-1]):
                _sync(target)
                started = time.perf_counter()
                result = decoder.generate(prompt, new_tokens, **kinds[kind])
                _sync(target)
                if i:
                    ms[kind].append(1000 * (time.perf_counter() - started) / result.stats.steps)
                if kind == "json_schema":
                    identical += result.token_ids == expected[i]
        report[f"budget_{budget}"] = {
            "identical_to_hf": identical, "of": len(prompts),
            "ms_per_step": {k: round(median(v), 2) for k, v in ms.items()},
            "constrained_over_free": round(median([c / f for c, f in zip(ms["json_schema"],
                                                                          ms["free"])]), 3)}
    return report


def _sync(model: Any) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def _attention_kernel(target: Any, batch: int, context: int) -> dict[str, Any]:
    """Triton vs the torch reference (max error), and it, the reference, transformers' SDPA
    path and torch's flex attention side by side (ms per call)."""
    from rag_spec_kernels.triton_tree_attention import triton_available

    if target.device.type != "cuda" or not triton_available():
        return {"skipped": "needs a GPU and Triton (the tests run it under the interpreter)"}
    report: dict[str, Any] = {"batch": batch, "context": context}
    for q_len, sparse in ((1, False), (4, False), (8, False), (4, True)):
        name = f"{q_len}_tokens" + ("_sparse_view" if sparse else "")
        report[name] = _kernel_case(target, batch, context, q_len, sparse)
    return report


def kernel_inputs(batch: int, heads: int, kv_heads: int, dim: int, context: int, q_len: int,
                  sparse: bool, device: Any = "cpu", dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """A kernel case: random queries, keys and values over ``context`` committed slots (17 of
    left padding) and a causal chain of ``q_len`` tokens, and its tree mask; with ``sparse`` a
    StreamingLLM view (4 sinks after the padding, the last 252 slots or fewer)."""
    from rag_spec_kernels import SparseView, TreeMask

    g = torch.Generator(device=device).manual_seed(q_len)
    query = torch.randn(batch, heads, q_len, dim, generator=g, device=device, dtype=dtype)
    key, value = (torch.randn(batch, kv_heads, context + q_len, dim, generator=g, device=device,
                              dtype=dtype) for _ in range(2))
    committed = torch.ones(batch, context, dtype=torch.bool, device=device)
    committed[:, :17] = False  # left padding
    view = None
    if sparse:
        window = min(252, context - 21)
        select = torch.cat([torch.arange(17, 21), torch.arange(context - window, context)])
        view = SparseView(select.to(device).repeat(batch, 1))
        committed = committed.gather(1, view.select)
    recent = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    return query, key, value, TreeMask(committed, recent.expand(batch, -1, -1), view)


def _kernel_case(target: Any, batch: int, context: int, q_len: int, sparse: bool
                 ) -> dict[str, Any]:
    from rag_spec_kernels import reference_attention
    from rag_spec_kernels.triton_tree_attention import triton_tree_attention

    config = target.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    query, key, value, mask = kernel_inputs(batch, heads, kv_heads, config.hidden_size // heads,
                                            context, q_len, sparse, target.device, target.dtype)
    got = triton_tree_attention(query, key, value, mask)
    expected = reference_attention(query.float(), key.float(), value.float(), mask)
    dense = mask.over_cache(context)[:, None]
    repeat = heads // kv_heads

    def stock() -> torch.Tensor:  # transformers' SDPA path: repeat_kv, a dense mask
        return torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1),
            attn_mask=dense)

    return {"max_error": round(float((got.float() - expected).abs().max()), 5),
            "triton_ms": _timed(target, lambda: triton_tree_attention(query, key, value, mask)),
            "reference_ms": _timed(target, lambda: reference_attention(query, key, value, mask,
                                                                       layer=0)),
            "stock_sdpa_ms": _timed(target, stock),
            **_flex_case(target, query, key, value, mask, expected, context)}


def _flex_case(target: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Any, expected: torch.Tensor, context: int) -> dict[str, Any]:
    """Flex attention's error and time on a kernel case, and its block mask's time (a step
    builds one); its failure is reported, not raised (the other kernels' figures stand)."""
    q_len = query.shape[2]
    try:
        flex, block_mask = _flex_attention(), _block_mask(mask, context, q_len)
        got = flex(query, key, value, block_mask=block_mask, enable_gqa=True)
        return {"flex_max_error": round(float((got.float() - expected).abs().max()), 5),
                "flex_ms": _timed(target, lambda: flex(query, key, value, block_mask=block_mask,
                                                       enable_gqa=True)),
                "flex_block_mask_ms": _timed(target, lambda: _block_mask(mask, context, q_len))}
    except Exception as error:  # noqa: BLE001 - a torch version without it, a shape it refuses
        return {"flex_error": f"{type(error).__name__}: {str(error)[:300]}"}


@functools.cache
def _flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _block_mask(mask: Any, context: int, q_len: int) -> Any:
    """Flex attention's block mask saying what ``mask`` says over the whole cache: a sparse
    view's slots are the only committed ones it lets through, so flex skips the blocks between
    the sinks and the window, as the kernels skip those slots."""
    from torch.nn.attention.flex_attention import create_block_mask

    allowed = mask.committed
    if mask.select is not None:
        allowed = torch.zeros(mask.committed.shape[0], context, dtype=torch.bool,
                              device=allowed.device).scatter(1, mask.select, mask.committed)
    recent = mask.recent

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        past = allowed[b, kv.clamp(max=context - 1)] & (kv < context)
        return past | (recent[b, q, (kv - context).clamp(min=0)] & (kv >= context))

    return create_block_mask(mask_mod, allowed.shape[0], None, q_len, context + q_len,
                             device=allowed.device)


def _timed(target: Any, call: Any, repeats: int = 10) -> float:
    call()
    _sync(target)
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    _sync(target)
    return round(1000 * (time.perf_counter() - started) / repeats, 3)


def _long_batch(target: Any, batch: int, context: int) -> dict[str, Any]:
    """Self-speculation on a batch of long random prompts (ragged), on the default kernels
    (exact numerics in half precision) and on the fast ones: identity with our decoding
    without drafts on the same kernels, row by row, and the costs its cost model measured."""
    from rag_spec.drafters.self_drafter import SelfSpecDrafter
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder

    g = torch.Generator().manual_seed(2)
    lengths = [context - b * max(1, context // (4 * batch)) for b in range(batch)]  # ragged
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=g).tolist()
               for n in lengths]
    report: dict[str, Any] = {"batch": batch, "context": context}
    for name, exact in (("default_kernels", "auto"), ("fast_kernels", False)):
        drafter = SelfSpecDrafter(budget=min(256, context // 2), probe_every=1)
        expected = LookaheadDecoder(target, config=LookaheadConfig(budget=0, exact=exact)
                                    ).generate(prompts, 16)
        got = LookaheadDecoder(target, config=LookaheadConfig(exact=exact), drafter=drafter
                               ).generate(prompts, 16)
        report[name] = {"identical_to_no_drafts": sum(a.token_ids == b.token_ids
                                                      for a, b in zip(got, expected)),
                        "of": batch, "self_spec": drafter.last.as_dict() if drafter.last else None}
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    """One panel per thing the report measured: speed against ``generate`` (hatched: output
    not identical to it), step costs by width, attention kernels' times; nothing without
    matplotlib (a GPU machine may lack it) or without any of them."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("gpu-check: no matplotlib, no plot")
        return
    panels = [draw for draw in (_race_panel(report), _steps_panel(report),
                                _kernel_panel(report)) if draw is not None]
    if not panels:
        return  # nothing this report measured is drawn
    fig, axes = figure(len(panels), (6.5 * len(panels), 4.5), squeeze=False)
    for draw, axis in zip(panels, axes[0]):
        draw(axis)
    weights = "random weights" if report["shape"] in ("tiny", "Llama-3-8B") else "its weights"
    save_figure(fig, path, f"{report['shape']} ({report['layers']} layers, {weights}), "
                           f"{report['dtype']}, {report['device']}")


def _race_panel(report: dict[str, Any]) -> Any:
    races = [(label.format(name), entry, report[section]["prompts"])
             for section, label in (("speed", "{}"), ("compiled_speed", "{} (compiled race)"))
             for name, entry in report.get(section, {}).items()
             if isinstance(entry, dict) and "speedup_vs_hf" in entry]
    if not races:
        return None

    def draw(axis: Any) -> None:
        bars = axis.barh([label for label, _, _ in races],
                         [e["speedup_vs_hf"] for _, e, _ in races])
        for bar, (_, entry, prompts) in zip(bars, races):
            if entry["identical_to_hf"] < prompts:
                bar.set_hatch("//")
                bar.set_alpha(0.5)
        axis.axvline(1.0, color="k", lw=0.8)
        axis.invert_yaxis()
        axis.set_xlabel("speed vs generate (median per prompt; hatched: not identical)")
    return draw


def _steps_panel(report: dict[str, Any]) -> Any:
    steps = report.get("step_ms", {})
    lines = {label: sorted((int(k[len(prefix):]), v) for k, v in steps.items()
                           if k.startswith(prefix) and k[len(prefix):].isdigit())
             for prefix, label in (("rag_spec_exact_", "ours, exact"),
                                   ("rag_spec_", "ours, fast"), ("hf_", "transformers"))}
    compiled = report.get("compiled_step", {})
    for key, label in (("eager_ms", "ours, eager (compiled_step)"),
                       ("compiled_ms", "ours, compiled (compiled_step)")):
        lines[label] = sorted((int(k), v) for k, v in compiled.get(key, {}).items())
    lines = {label: points for label, points in lines.items() if points}
    if not lines:
        return None

    def draw(axis: Any) -> None:
        for label, points in lines.items():
            axis.plot(*zip(*points), marker="o", label=label)
        axis.set_xlabel("tokens in the step")
        axis.set_ylabel("ms per step")
        axis.legend()
    return draw


def _kernel_panel(report: dict[str, Any]) -> Any:
    kernels = report.get("attention_kernel", {})
    cases = [name for name, entry in kernels.items()
             if isinstance(entry, dict) and "triton_ms" in entry]
    if not cases:
        return None
    systems = {key: label for key, label in (
        ("triton_ms", "ours, Triton"), ("reference_ms", "ours, torch reference"),
        ("flex_ms", "flex attention"), ("stock_sdpa_ms", "transformers' SDPA path"))
        if any(key in kernels[case] for case in cases)}

    def draw(axis: Any) -> None:
        width = 0.8 / len(systems)
        for i, (key, label) in enumerate(systems.items()):
            axis.bar([c + i * width for c in range(len(cases))],
                     [kernels[case].get(key, 0.0) for case in cases], width, label=label)
        axis.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))],
                        [case.replace("_tokens", " tok").replace("_sparse_view", ", sparse")
                         for case in cases])
        axis.set_ylabel(f"ms per attention call (batch {kernels['batch']}, "
                        f"{kernels['context']} keys)")
        axis.legend()
    return draw


if __name__ == "__main__":
    main()
