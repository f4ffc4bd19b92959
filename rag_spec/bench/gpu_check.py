"""``make gpu-check``: the engine on an accelerator, with random weights of a realistic shape.

Machines with a GPU here reach no model hub, so the check builds a Llama of Llama-3-8B's shape
(fewer layers by default, to fit a short lease) with random weights in bf16, and reports:

- greedy identity with transformers ``generate`` for the trie (also with exact numerics), a
  draft model (the target's first layers, saved as a model of its own), the early-exit draft
  and the merged drafter, at batch 1 and 4;
- multi-step speculative sampling against plain sampling on the first token (total variation
  distance between the two empirical distributions, with the bound that sampling noise allows);
- step costs: one verification step over 1, 8, 16 and 32 tokens at a long context;
- the tree-attention kernel (Triton) against its torch reference and against transformers'
  attention (KV heads repeated, a dense mask) at batch 16 and a long context, chains of 1 to 8
  tokens and a StreamingLLM selection; and self-speculation's steps at that batch: a one-token
  step, a 4-token verification, a draft pass through the sparse view.

Random weights make near ties rarer than a trained model's; peaked logits (a large
initializer) keep greedy decoding stable under bf16. Run ``python -m rag_spec.bench.gpu_check
--tiny`` anywhere (the tests do, on the CPU) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 96}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the script)")
    parser.add_argument("--layers", type=int, default=8, help="target layers (8B has 32)")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=2048, help="context of the step costs")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = _random_llama(TINY if args.tiny else LLAMA3_8B, args.layers, device, dtype)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                              else "cpu", "dtype": str(dtype), "layers": args.layers,
                              "shape": "tiny" if args.tiny else "Llama-3-8B"}
    report["greedy_identical"] = _greedy(target, args.draft_layers, 24 if args.tiny else 64)
    report["sampling"] = _sampling(target, args.draft_layers, 400 if args.tiny else 2000)
    report["step_ms"] = _step_costs(target, 64 if args.tiny else args.context)
    report["attention_kernel"] = _attention_kernel(target, 16, 64 if args.tiny else 4096)
    report["long_context_batch"] = _long_batch(target, 4 if args.tiny else 16,
                                               64 if args.tiny else args.context)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
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


def _first_layers(model: Any, count: int) -> Any:
    from transformers import LlamaForCausalLM

    config = type(model.config).from_dict(model.config.to_dict())
    config.num_hidden_layers = count
    with torch.device(model.device):
        draft = LlamaForCausalLM(config).to(model.dtype).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    draft.generation_config.eos_token_id = None
    return draft


def _drafters(target: Any, draft_layers: int) -> dict[str, Any]:
    from rag_spec.decoding import (
        DraftModelDrafter,
        EarlyExitDrafter,
        MergedDrafter,
        SelfSpecDrafter,
    )

    draft = _first_layers(target, draft_layers)
    return {"trie": None, "draft_model": DraftModelDrafter(draft),
            "early_exit": EarlyExitDrafter(draft_layers),
            "merged": MergedDrafter(DraftModelDrafter(draft)),
            # a view smaller than the prompts (48 tokens): the sparse path drafts
            "self_spec": SelfSpecDrafter(budget=24, sinks=4, probe_every=1)}


def _prompts(vocab: int, count: int, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = []
    for _ in range(count):
        phrase = torch.randint(3, vocab, (12,), generator=g).tolist()
        prompts.append((phrase * (length // 12 + 1))[:length])  # repeats: the trie drafts
    return prompts


def _greedy(target: Any, draft_layers: int, new_tokens: int) -> dict[str, Any]:
    from rag_spec.decoding import LookaheadConfig, LookaheadDecoder

    prompts = _prompts(target.config.vocab_size, 4)
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device=target.device)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens)
        expected.append(out[0, len(p):].tolist())
    decoders = {name: LookaheadDecoder(target, drafter=drafter)
                for name, drafter in _drafters(target, draft_layers).items()}
    # exact numerics (per-token attention, row-invariant products): bit for bit generate's
    decoders["trie_exact"] = LookaheadDecoder(target, config=LookaheadConfig(exact=True))
    results = {}
    for name, decoder in decoders.items():
        alone = [decoder.generate(p, new_tokens) for p in prompts]
        batch = decoder.generate(prompts, new_tokens)
        results[name] = {
            "batch1": sum(r.token_ids == e for r, e in zip(alone, expected)),
            "batch4": sum(r.token_ids == e for r, e in zip(batch, expected)),
            "of": len(prompts),
            "tokens_per_step": round(sum(r.stats.tokens_per_step for r in alone) / len(alone), 3)}
    return results


def _sampling(target: Any, draft_layers: int, samples: int) -> dict[str, Any]:
    """First-token distribution of speculative sampling vs the exact one, as total variation."""
    from rag_spec.decoding import DraftModelDrafter, LookaheadDecoder

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


def _step_costs(target: Any, context: int) -> dict[str, float]:
    from rag_spec.bench.floor import runner_step_seconds

    prompt = torch.randint(3, target.config.vocab_size, (context,)).tolist()
    costs = runner_step_seconds(target, prompt, (1, 8, 16, 32), repeats=5)
    return {f"{width}_tokens": round(1000 * seconds, 2) for width, seconds in costs.items()}


def _sync(model: Any) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def _attention_kernel(target: Any, batch: int, context: int) -> dict[str, Any]:
    """Triton vs the torch reference (max error) and the three side by side (ms per call)."""
    from rag_spec_kernels.triton_tree_attention import triton_available

    if target.device.type != "cuda" or not triton_available():
        return {"skipped": "needs a GPU and Triton (the tests run it under the interpreter)"}
    report: dict[str, Any] = {"batch": batch, "context": context}
    for q_len, sparse in ((1, False), (4, False), (8, False), (4, True)):
        name = f"{q_len}_tokens" + ("_sparse_view" if sparse else "")
        report[name] = _kernel_case(target, batch, context, q_len, sparse)
    return report


def _kernel_case(target: Any, batch: int, context: int, q_len: int, sparse: bool
                 ) -> dict[str, Any]:
    from rag_spec_kernels import SparseView, TreeMask, reference_attention
    from rag_spec_kernels.triton_tree_attention import triton_tree_attention

    config, device = target.config, target.device
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    g = torch.Generator(device=device).manual_seed(q_len)
    query = torch.randn(batch, heads, q_len, dim, generator=g, device=device, dtype=target.dtype)
    key, value = (torch.randn(batch, kv_heads, context + q_len, dim, generator=g, device=device,
                              dtype=target.dtype) for _ in range(2))
    committed = torch.ones(batch, context, dtype=torch.bool, device=device)
    committed[:, :17] = False  # left padding
    view = None
    if sparse:  # StreamingLLM: 4 sinks after the padding, the last 252 slots
        select = torch.cat([torch.arange(17, 21), torch.arange(context - 252, context)])
        view = SparseView(select.to(device).repeat(batch, 1))
        committed = committed.gather(1, view.select)
    recent = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    mask = TreeMask(committed, recent.expand(batch, -1, -1), view)
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
            "stock_sdpa_ms": _timed(target, stock)}


def _timed(target: Any, call: Any, repeats: int = 10) -> float:
    call()
    _sync(target)
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    _sync(target)
    return round(1000 * (time.perf_counter() - started) / repeats, 3)


def _long_batch(target: Any, batch: int, context: int) -> dict[str, Any]:
    """Self-speculation on a batch of long random prompts (ragged): identity with generate on
    each row, and the step costs its cost model measured."""
    from rag_spec.decoding import LookaheadConfig, LookaheadDecoder, SelfSpecDrafter

    g = torch.Generator().manual_seed(2)
    lengths = [context - b * max(1, context // (4 * batch)) for b in range(batch)]  # ragged
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=g).tolist()
               for n in lengths]
    drafter = SelfSpecDrafter(budget=min(256, context // 2), probe_every=1)
    expected = LookaheadDecoder(target, config=LookaheadConfig(budget=0)).generate(prompts, 16)
    got = LookaheadDecoder(target, drafter=drafter).generate(prompts, 16)
    return {"batch": batch, "context": context,
            "identical_to_no_drafts": sum(a.token_ids == b.token_ids
                                          for a, b in zip(got, expected)),
            "of": batch, "self_spec": drafter.last.as_dict() if drafter.last else None}


if __name__ == "__main__":
    main()
