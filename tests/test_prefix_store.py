"""Stored prompt prefixes: a prompt that begins as an earlier one did reads that beginning's
KV entries instead of computing them, only where a token's entries are the same in any pass
(the GGUF weights' row-by-row passes), and then decodes exactly as without the store."""

import pytest
import test_quantized
import torch
from test_quantized import kernel_or_skip

from rag_spec.target.transformers.prefix_store import PrefixStore

quantized_lm = test_quantized.quantized_lm  # the tiny Llama on a GGUF file's weights (fixture)


def entries(length, layers=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, length, 8, generator=generator),
             torch.randn(3, length, 8, generator=generator)) for _ in range(layers)]


def test_the_store_finds_the_longest_stored_prefix_and_cuts_it_to_the_common_tokens():
    store = PrefixStore(2**20)
    assert store.longest([1, 2, 3]).length == 0
    first, second = entries(4), entries(3, seed=1)
    store.keep([1, 2, 3, 4], first)
    store.keep([1, 2, 9], second)
    found = store.longest([1, 2, 3, 7, 7])
    assert found.length == 3
    assert torch.equal(found.entries[1][0][0], first[1][0][:, :3])
    assert found.entries[0][1].shape == (1, 3, 3, 8)
    assert store.longest([1, 2, 9, 9]).length == 3
    assert torch.equal(store.longest([1, 2, 9]).entries[0][0][0], second[0][0])
    assert store.longest([5]).length == 0


def test_the_store_keeps_copies_replaces_what_a_prompt_extends_and_evicts_the_oldest():
    first = entries(4)
    store = PrefixStore(2 * sum(k.nbytes + v.nbytes for k, v in entries(6)))
    store.keep([1, 2, 3, 4], first)
    first[0][0].zero_()  # the caller's tensors are its own
    assert store.longest([1, 2, 3, 4]).entries[0][0].abs().sum() > 0
    store.keep([1, 2, 3, 4, 5, 6], entries(6))  # a conversation's next turn: one entry
    assert len(store) == 1 and store.longest([1, 2, 3, 4, 5, 6, 7]).length == 6
    store.keep([8, 8, 8, 8, 8, 8], entries(6))
    store.longest([1, 2])  # read: now the most recent
    store.keep([9, 9, 9, 9, 9, 9], entries(6))  # past the bound: the least recent goes
    assert store.longest([8, 8]).length == 0 and store.longest([1, 2]).length == 2
    assert store.nbytes <= store.max_bytes
    store.keep(list(range(50)), entries(50))  # larger than the whole bound: not kept
    assert store.longest(list(range(50))).length == 0
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


def cache_entries(tree):
    from rag_spec.target.transformers.kv_cache import layers

    width = tree.valid.shape[1]
    return [(layer.keys[:, :, :width], layer.values[:, :, :width])
            for layer in layers(tree.cache)]


def test_a_prompt_prefilled_from_a_stored_prefix_gets_its_whole_passs_entries(quantized_lm):
    """Bit for bit, at every place the stored prefix can end (a token, a few, all but one);
    padded in a batch beside a prompt that reads nothing, too."""
    from test_entry_matrix import prompts

    from rag_spec import LookaheadConfig, LookaheadDecoder
    from rag_spec.target.transformers.prefill import prefill, prefill_reusing

    kernel_or_skip()
    lm = quantized_lm
    runner = LookaheadDecoder(lm.model, lm.tokenizer,
                              LookaheadConfig(quantized=True, compile=False)).runner
    assert runner.row_invariant
    one, two = prompts(lm)
    with torch.inference_mode():
        whole = cache_entries(prefill(runner, [one]))
        for cut in (1, 2, 7, len(one) - 2, len(one) - 1):
            store = PrefixStore(2**30)
            prefill_reusing(runner, [one[:cut + 1]], store)  # stores one[:cut]
            tree, read = prefill_reusing(runner, [one, two], store)
            assert read == [cut, 0]
            for (keys, values), (k, v) in zip(whole, cache_entries(tree)):
                assert torch.equal(keys[0], k[0, :, -keys.shape[2]:])
                assert torch.equal(values[0], v[0, :, -values.shape[2]:])
            assert store.longest(one).length == len(one) - 1  # what it computed, kept


def test_a_conversations_next_turn_reads_the_last_prompt_and_decodes_as_without_it(
        quantized_lm):
    """Every drafter-free and drafted decoding on the file's weights: the next turn (the last
    prompt, its answer, a new message) reads the last prompt's entries, and its tokens are
    those of a decoder that stores nothing; so do a batch's rows that read and rows that do
    not, and a stream."""
    from test_entry_matrix import N, prompts

    from rag_spec import LookaheadConfig, LookaheadDecoder

    kernel_or_skip()
    lm = quantized_lm
    one, two = prompts(lm)
    for budget in (0, 8):
        stored = LookaheadDecoder(lm.model, lm.tokenizer,
                                  LookaheadConfig(budget=budget, quantized=True, compile=False))
        plain = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(
            budget=budget, quantized=True, compile=False, prefix_cache_mb=0))
        first = stored.generate(one, N)
        assert first.stats.cached_prompt_tokens == 0
        turn = one + first.token_ids + two[:20]
        second = stored.generate(turn, N)
        assert second.stats.cached_prompt_tokens == len(one) - 1
        assert second.token_ids == plain.generate(turn, N).token_ids
        batch = [turn + two[20:30], two, one[:12]]
        results = stored.generate(batch, N)
        assert [r.stats.cached_prompt_tokens for r in results] == [len(turn) - 1, 0, 11]
        assert [r.token_ids for r in results] == [plain.generate(p, N).token_ids
                                                  for p in batch]
        stream = stored.stream(two + one[:9], N)
        assert "".join(stream) == plain.generate(two + one[:9], N).text
        assert stream.result.stats.cached_prompt_tokens == len(two) - 1
        assert plain._prefixes is None


def test_no_prefix_is_stored_where_a_chunked_prefill_rounds_otherwise(quantized_lm):
    """float32 weights (oneDNN products, SDPA prefill) and exact numerics (generate's own
    whole prefill): a prompt computes every entry."""
    from test_entry_matrix import N, prompts

    from rag_spec import LookaheadConfig, LookaheadDecoder

    lm = quantized_lm
    one, _ = prompts(lm)
    for config in (LookaheadConfig(quantized=False, compile=False),
                   LookaheadConfig(quantized=False, compile=False, exact=True)):
        decoder = LookaheadDecoder(lm.model, lm.tokenizer, config)
        assert not decoder.runner.row_invariant
        decoder.generate(one, N)
        assert decoder.generate(one + [5, 6], N).stats.cached_prompt_tokens == 0
        assert decoder._prefixes is None


@pytest.mark.e2e
def test_the_embedded_model_reads_an_agents_earlier_turns_and_answers_as_without(user_cache):
    """The embedded file's GGUF default, compiled steps: a tool-calling conversation's turns."""
    import rag_spec

    kernel_or_skip()
    lm = rag_spec.load_model()
    stored = rag_spec.LookaheadDecoder(lm.model, lm.tokenizer)
    plain = rag_spec.LookaheadDecoder(lm.model, lm.tokenizer,
                                      rag_spec.LookaheadConfig(prefix_cache_mb=0))
    assert stored.runner.weights == "GGUF"
    messages = [{"role": "system", "content": "You answer questions about the Python standard "
                                              "library, briefly, citing the module."},
                {"role": "user", "content": "How do I read a CSV file?"}]
    read = []
    for question in ("And write one?", "Which module parses JSON?"):
        ids = rag_spec.chat_input_ids(lm.tokenizer, messages)
        answer = stored.generate(ids, 40)
        assert answer.token_ids == plain.generate(ids, 40).token_ids
        read.append(answer.stats.cached_prompt_tokens)
        messages += [{"role": "assistant", "content": answer.text},
                     {"role": "user", "content": question}]
    assert read[0] == 0 and read[1] > 20


def test_a_file_with_a_de_quantised_layer_stores_no_prefix(quantized_lm):
    """Formats without a kernel stay float32, whose products round by the pass's row count:
    one such layer and a token's entries depend on the pass."""
    from rag_spec.target.gguf import file_weights
    from rag_spec.target.transformers.runner import _every_layer_quantized

    blocks = dict(file_weights(quantized_lm.model))
    assert _every_layer_quantized(quantized_lm.model, blocks)
    assert _every_layer_quantized(quantized_lm.model, {k: v for k, v in blocks.items()
                                                       if k != "lm_head"})  # logits only
    blocks.pop(next(k for k in blocks if "layers.1." in k))
    assert not _every_layer_quantized(quantized_lm.model, blocks)
