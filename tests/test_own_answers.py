"""The model's own answers, to train a draft on: prompts about the user's passages and questions
the model writes itself, each answered with exactly the model's greedy tokens."""

import pytest

from conftest import char_tokenizer, tiny_llama
from rag_spec.corpus import Passage
from rag_spec.engine.decoder import LookaheadDecoder
from rag_spec.training.own_answers import own_answers, user_turn_opening, written_questions
from test_decoder_greedy import hf_greedy

PASSAGES = [Passage(f"t{c}", f"words on {c}") for c in "abcdef"]
TEMPLATE = ("{% for m in messages %}q {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a {% endif %}")


def test_answers_are_the_models_own_greedy_answers_to_questions_about_the_passages():
    model, tokenizer = tiny_llama(vocab_size=35, eos=2), char_tokenizer()  # no chat template
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    answered = own_answers(model, tokenizer, PASSAGES, 4, max_new_tokens=6, progress=False)
    assert len(answered) == 4  # all about passages: without a template it writes no questions
    long = [Passage("t", "many words " * 30)] * 3  # three of them overflow the 256-token window
    assert own_answers(model, tokenizer, long, 2, max_new_tokens=6, progress=False) == []
    for prompt, answer in answered:
        assert any(p.text in tokenizer.decode(prompt) for p in PASSAGES)
        assert answer == hf_greedy(model, prompt, 6)
    assert all(v.equal(weights[k]) for k, v in model.state_dict().items())


def test_the_model_writes_questions_when_its_template_opens_a_user_turn():
    model, tokenizer = tiny_llama(vocab_size=35, eos=2), char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    assert user_turn_opening(tokenizer) == "q "
    assert user_turn_opening(char_tokenizer()) is None
    decoder = LookaheadDecoder(model, tokenizer)
    questions = written_questions(decoder, 3, seed=0)
    assert 0 < len(questions) <= 3 and all(q == q.strip() and q for q in questions)
    assert written_questions(decoder, 3, seed=0) == questions  # seeded
    answered = own_answers(model, tokenizer, PASSAGES, 6, max_new_tokens=6, progress=False)
    texts = [tokenizer.decode(prompt) for prompt, _ in answered]
    assert all(t.startswith("q ") and t.endswith("a ") for t in texts)  # the template's turns
    about = [t for t in texts if any(p.text in t for p in PASSAGES)]
    assert len(about) == 6 - len(questions)
    assert [f"q {q}\na " for q in questions] == texts[len(about):]
    assert all(answer == hf_greedy(model, prompt, 6) for prompt, answer in answered)


def test_answers_to_written_questions_only_when_asked():
    model, tokenizer = tiny_llama(vocab_size=35, eos=2), char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    questions = written_questions(LookaheadDecoder(model, tokenizer), 4, seed=1)
    answered = own_answers(model, tokenizer, PASSAGES, 4, written_share=1.0, seed=1,
                           max_new_tokens=6, progress=False)
    texts = [tokenizer.decode(prompt) for prompt, _ in answered]
    about = [t for t in texts if any(p.text in t for p in PASSAGES)]
    assert len(questions) == 4 and about == []  # every prompt a question it wrote
    assert [f"q {q}\na " for q in questions] == texts


def test_the_questions_written_do_not_depend_on_which_draft_head_exists():
    # the questions are sampled: drafts that are drawn (a head's) would change the draws, and
    # a head trained on them would not be trained again from the same texts
    import torch

    from rag_spec.drafters.draft_head import find_head, publish_head
    from rag_spec.training.train_head import train_head

    model, tokenizer = tiny_llama(vocab_size=35, eos=2), char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    asked = {"passages": PASSAGES, "count": 8, "written_share": 1.0, "seed": 3,
             "max_new_tokens": 12, "progress": False}
    before = own_answers(model, tokenizer, **asked)
    texts = torch.randint(3, 35, (12, 24), generator=torch.Generator().manual_seed(0)).tolist()
    publish_head(model, train_head(model, texts, vocabulary=32, epochs=1, progress=False))
    assert find_head(model) is not None  # a default decoder would draft with it now
    assert own_answers(model, tokenizer, **asked) == before


def test_answers_are_kept_and_reused_until_the_model_or_the_question_changes(monkeypatch,
                                                                             capsys):
    import torch

    import rag_spec.training.own_answers as answering
    from rag_spec.paths import cache_dir

    model, tokenizer = tiny_llama(vocab_size=35, eos=2), char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    asked = {"written_share": 0.5, "seed": 4, "max_new_tokens": 6}
    before = set((cache_dir() / "answers").glob("*.json"))
    first = answering.remembered_answers(model, tokenizer, PASSAGES, 4, progress=False, **asked)
    assert first == own_answers(model, tokenizer, PASSAGES, 4, progress=False, **asked)
    [kept] = set((cache_dir() / "answers").glob("*.json")) - before

    def answering_again(*args, **kwargs):
        msg = "answered again"
        raise AssertionError(msg)

    real = answering.own_answers
    monkeypatch.setattr(answering, "own_answers", answering_again)
    assert answering.remembered_answers(model, tokenizer, PASSAGES, 4, progress=True,
                                        **asked) == first
    assert "4 answers, kept from an earlier run" in capsys.readouterr().err
    for other in ({**asked, "seed": 5}, {**asked, "max_new_tokens": 7}):  # another question
        with pytest.raises(AssertionError, match="answered again"):
            answering.remembered_answers(model, tokenizer, PASSAGES, 4, progress=False, **other)
    with pytest.raises(AssertionError, match="answered again"):  # fewer answers
        answering.remembered_answers(model, tokenizer, PASSAGES, 3, progress=False, **asked)
    tuned = tiny_llama(vocab_size=35, eos=2)
    with torch.no_grad():
        tuned.lm_head.weight.mul_(2)  # the same shape, another model
    with pytest.raises(AssertionError, match="answered again"):
        answering.remembered_answers(tuned, tokenizer, PASSAGES, 4, progress=False, **asked)

    kept.write_text('[[1, 2], "damaged')  # a file cut short: answered again and replaced
    monkeypatch.setattr(answering, "own_answers", real)
    assert answering.remembered_answers(model, tokenizer, PASSAGES, 4, progress=False,
                                        **asked) == first
    assert "could not be read" in capsys.readouterr().err
    monkeypatch.setattr(answering, "own_answers", answering_again)
    assert answering.remembered_answers(model, tokenizer, PASSAGES, 4, progress=False,
                                        **asked) == first


@pytest.mark.parametrize("stopped_in", ["writing", "answering"])
def test_answering_that_stopped_goes_on_from_its_last_batch_with_the_same_answers(
        monkeypatch, capsys, stopped_in):
    import rag_spec.training.own_answers as answering
    from rag_spec.paths import cache_dir

    model, tokenizer = tiny_llama(vocab_size=35, eos=2), char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    # a question of its own per case: answers kept by one are not the other's
    asked = {"written_share": 0.5, "seed": 6 + (stopped_in == "answering"), "max_new_tokens": 6}
    real, calls = LookaheadDecoder.generate, []

    def generate(decoder, prompts, **kwargs):
        calls.append("writing" if kwargs.get("do_sample") else "answering")
        if stop and calls.count(stopped_in) == 2:
            raise KeyboardInterrupt
        return real(decoder, prompts, **kwargs)

    monkeypatch.setattr(LookaheadDecoder, "generate", generate)
    stop = False
    whole = own_answers(model, tokenizer, PASSAGES, 24, progress=False, **asked)
    unstopped = list(calls)
    assert unstopped.count("writing") >= 2 and unstopped.count("answering") == 3  # 8 + 8 + 2
    stop, calls[:] = True, []
    with pytest.raises(KeyboardInterrupt):
        answering.remembered_answers(model, tokenizer, PASSAGES, 24, progress=False, **asked)
    stop, calls[:] = False, []
    assert answering.remembered_answers(model, tokenizer, PASSAGES, 24, progress=True,
                                        **asked) == whole
    # the first batch of the kind it stopped in is kept, and everything before it
    assert calls == unstopped[unstopped.index(stopped_in) + 1:]
    if stopped_in == "answering":
        assert f"({answering._BATCH} answered," in capsys.readouterr().err
    assert not list((cache_dir() / "answers").glob("*.partial.json"))


@pytest.mark.parametrize("kept", ['{"prompts": [[1, 2]], "answ', '{"prompts": [[1]], "answers": 3}',
                                  '{"prompts": [[1], [2]], "answers": [[3], [4], [5]]}',
                                  '{"prompts": [[1]] , "answers": []}'])
def test_what_a_stopped_run_kept_is_taken_up_only_when_it_is_whole_batches_of_its_prompts(
        tmp_path, kept):
    from rag_spec.training.own_answers import PartialAnswers

    partial = PartialAnswers(tmp_path / "partial.json")
    partial.path.write_text(kept)
    taken = partial.load()
    assert taken == (([[1]], []) if kept.endswith("[]}") else ([], []))
    partial.save([[1], [2]], [([1], [7, 8]), ([2], [9])])  # every prompt answered
    assert partial.load() == ([[1], [2]], [([1], [7, 8]), ([2], [9])])
