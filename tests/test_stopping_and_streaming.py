"""Stop strings, streaming and bad input on a character-level model, against plain decoding."""

import pytest
import torch

from conftest import tiny_llama
from rag_spec.engine.decoder import LookaheadDecoder
from rag_spec.errors import RagSpecError


@pytest.fixture(scope="module")
def char_model(tokenizer):
    return tiny_llama(seed=3, vocab_size=len(tokenizer))


def plain(model, prompt, n):
    return model.generate(torch.tensor([prompt]), max_new_tokens=n,
                          do_sample=False)[0, len(prompt):].tolist()


def prompt_ids(tokenizer, text="the cat sat. the cat sat. the"):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_stop_string_across_tokens_ends_where_plain_decoding_would(char_model, tokenizer):
    prompt = prompt_ids(tokenizer)
    reference = plain(char_model, prompt, 60)
    text = tokenizer.decode(reference)
    stop = text[20:23]  # three characters = three tokens, inside the plain output
    assert len(stop) == 3
    # Plain decoding would stop at the first token after which the text contains the stop.
    end = next(i for i in range(1, 61) if stop in tokenizer.decode(reference[:i]))
    decoder = LookaheadDecoder(char_model, tokenizer)
    decoder.drafter.remember(prompt + reference)  # drafts run straight through the stop
    result = decoder.generate(prompt, 60, stop=[stop])
    assert result.token_ids == reference[:end]
    assert result.finish_reason == "stop"
    assert result.text == text[:text.index(stop)]


def test_stream_pieces_concatenate_to_the_text(char_model, tokenizer):
    prompt = prompt_ids(tokenizer)
    reference = plain(char_model, prompt, 40)
    stop = tokenizer.decode(reference)[30:32]
    decoder = LookaheadDecoder(char_model, tokenizer)
    decoder.drafter.remember(prompt + reference)
    pieces: list[str] = []
    result = decoder.generate(prompt, 40, stop=[stop], streamer=pieces.append)
    assert len(pieces) > 1
    assert "".join(pieces) == result.text
    assert stop not in "".join(pieces)


def test_transformers_streamer_gets_the_tokens(char_model, tokenizer):
    from transformers import TextStreamer

    class Collect(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            self.seen = getattr(self, "seen", "") + text

    streamer = Collect(tokenizer, skip_prompt=True)
    result = LookaheadDecoder(char_model, tokenizer).generate(prompt_ids(tokenizer), 20,
                                                              streamer=streamer)
    assert streamer.seen == result.text


@pytest.mark.parametrize("call, match", [
    (lambda d: d.generate([], 5), "empty"),
    (lambda d: d.generate([[1, 2], []], 5), "empty"),
    (lambda d: d.generate([1, 2], 0), "max_new_tokens"),
    (lambda d: d.generate([1] * 300, 5), "context window"),
    (lambda d: d.generate([[1], [2]], 5, streamer=print), "one prompt"),
])
def test_bad_input_gets_a_clear_error(char_model, tokenizer, call, match):
    with pytest.raises(RagSpecError, match=match):
        call(LookaheadDecoder(char_model, tokenizer))


def test_stop_strings_need_a_tokenizer(char_model):
    with pytest.raises(RagSpecError, match="tokenizer"):
        LookaheadDecoder(char_model).generate([1, 2, 3], 5, stop=["x"])


def test_encoder_decoder_models_are_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32,
                                             num_layers=1, num_heads=2))
    with pytest.raises(RagSpecError, match="encoder-decoder"):
        LookaheadDecoder(t5)


def test_generation_stops_at_the_context_window(tokenizer):
    model = tiny_llama(seed=3, vocab_size=len(tokenizer))
    result = LookaheadDecoder(model).generate([5] * 250, 100)  # window is 256
    assert len(result.token_ids) == 6
    assert result.finish_reason == "length"


def assert_stream_matches_generate(decoder, prompt, max_new_tokens: int):
    """``decoder.stream`` yields several pieces that join to ``generate``'s text, and ends
    with its tokens."""
    expected = decoder.generate(prompt, max_new_tokens=max_new_tokens)
    stream = decoder.stream(prompt, max_new_tokens=max_new_tokens)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == expected.text
    assert stream.result.token_ids == expected.token_ids
    return stream


def test_decoder_stream_on_the_callers_thread_matches_generate(tokenizer):
    decoder = LookaheadDecoder(tiny_llama(vocab_size=len(tokenizer)), tokenizer)
    prompt = tokenizer("the cat sat on the mat. the cat")["input_ids"]
    stream = assert_stream_matches_generate(decoder, prompt, 30)
    assert list(stream) == []  # a finished stream yields nothing more
    early = decoder.stream(prompt, max_new_tokens=30)
    for _ in early:
        break
    assert early.result is None
    assert decoder.generate(prompt, max_new_tokens=30).token_ids == stream.result.token_ids  # freed
