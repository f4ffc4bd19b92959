"""Architectures beyond Llama decode as ``generate`` does, in ragged batches (padding leaves
holes the masks must skip). Each family exercises something the decoder must not break: QK
norms, learned absolute positions, parallel residuals, partial rotary embeddings, layers
without rotary embeddings, scaled embeddings and logits, mixtures of experts, and sliding
windows on every layer or mixed with full layers, and layers that do not hand keywords on to
their attention. (Llama, Mistral, Gemma 3 and Qwen2's mixed layers are in ``test_tree_cache``.)"""

import pytest
import torch
import transformers

from conftest import TINY_SHAPE
from rag_spec.engine.decoder import LookaheadDecoder
from test_decoder_greedy import hf_greedy, repetitive_prompt

MIXED = ["sliding_attention", "sliding_attention", "full_attention"]
FAMILIES = {  # name: (config class, model class, settings beyond SHAPE)
    "qwen3 (QK norms)": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "phi3 (sliding window)": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 7}),
    "smollm3 (layers without rotary)": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "cohere2 (mixed sliding layers)": ("Cohere2Config", "Cohere2ForCausalLM",
                                       {"sliding_window": 6, "layer_types": MIXED}),
    "granite (scaled embeddings, logits)": ("GraniteConfig", "GraniteForCausalLM",
                                            {"embedding_multiplier": 2.0,
                                             "attention_multiplier": 0.3,
                                             "residual_multiplier": 0.5,
                                             "logits_scaling": 2.0}),
    "mixtral (experts, sliding window)": ("MixtralConfig", "MixtralForCausalLM",
                                          {"num_local_experts": 2, "sliding_window": 6}),
    "phi (partial rotary)": ("PhiConfig", "PhiForCausalLM", {}),
    "gpt-neox (parallel residual)": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gpt2 (learned positions)": ("GPT2Config", "GPT2LMHeadModel", {"n_positions": 256}),
    "opt (learned positions, offset)": ("OPTConfig", "OPTForCausalLM",
                                        {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    # its layers call attention without the forward's keywords: tree masks go by context
    "stablelm (layers drop keywords)": ("StableLmConfig", "StableLmForCausalLM", {}),
}


PROMPTS = [(repetitive_prompt(s) * 2)[:n] for s, n in enumerate((40, 25, 70))]


def tiny_family(family: str):
    config_class, model_class, settings = FAMILIES[family]
    torch.manual_seed(11)
    config = getattr(transformers, config_class)(**TINY_SHAPE, **settings)
    model = getattr(transformers, model_class)(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def decodes_as_generate(model) -> bool:
    results = LookaheadDecoder(model).generate(PROMPTS, 20)
    return [r.token_ids for r in results] == [hf_greedy(model, p, 20) for p in PROMPTS]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_ragged_batch_decodes_as_generate(family):
    assert decodes_as_generate(tiny_family(family))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (make gpu-check runs it)")
def test_on_a_gpu_every_family_decodes_as_generate():
    """The GPU's kernels (Triton tree attention, SDPA's CUDA backends) reached through each
    family's attention, float32, with Gemma 3's per-kind dense masks among them."""
    from test_tree_cache import tiny_mixed

    models = {family: tiny_family(family) for family in FAMILIES}
    models["gemma3 (mixed sliding layers)"] = tiny_mixed("gemma3")
    assert [name for name, model in models.items()
            if not decodes_as_generate(model.cuda())] == []
