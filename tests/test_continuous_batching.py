"""Continuous batching: rows join a batch in flight between steps and leave when they end,
and every row's tokens are the ones it gets alone (greedy: generate's)."""

import pytest

from conftest import tiny_llama
from rag_spec.drafters.model_drafter import DraftModelDrafter
from rag_spec.engine.batch import CANCELLED, LiveBatch
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder
from rag_spec.errors import RagSpecError
from rag_spec.serving.scheduler import Scheduler
from test_decoder_greedy import hf_greedy, repetitive_prompt


def joined_midway(decoder, prompts, new_tokens, joins):
    """Decode ``prompts`` in one batch, prompt ``i`` joining after ``joins[i]`` steps; returns
    each row's tokens and the live row count of every step."""
    batch = decoder.open_batch()
    rows, live = [None] * len(prompts), []
    try:
        step = 0
        while step <= max(joins) or batch.live:
            arriving = [i for i, at in enumerate(joins) if at == step]
            for i in arriving:
                rows[i] = decoder.new_rows(prompts[i], new_tokens[i])[0]
            batch.join([rows[i] for i in arriving])
            if batch.live:
                live.append(len(batch.live))
                batch.step()
            step += 1
    finally:
        batch.close()
    return [r.result().token_ids for r in rows], live


@pytest.mark.parametrize("exact", [False, True])
def test_rows_that_join_midway_get_the_tokens_they_get_alone(model, flat_step_costs, exact):
    """Newcomers longer and shorter than the batch's cache, while others are mid-answer and
    after some have ended: every row's tokens are generate's."""
    decoder = LookaheadDecoder(model, config=LookaheadConfig(exact=exact))
    prompts = [repetitive_prompt(s, length=12 + 11 * s) for s in range(4)]
    new_tokens = [30, 8, 25, 20]
    tokens, live = joined_midway(decoder, prompts, new_tokens, joins=[0, 0, 3, 12])
    assert tokens == [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens)]
    assert max(live) >= 3  # the newcomers decoded beside rows already in flight


def test_a_draft_models_own_cache_follows_the_rows_that_join(model, flat_step_costs):
    """A drafter with batch state of its own (a draft model's cache) rebuilds it for the new
    batch: drafts keep being accepted, and tokens stay generate's."""
    drafter = DraftModelDrafter(tiny_llama(seed=0))  # the target itself: drafts agree
    decoder = LookaheadDecoder(model, drafter=drafter)
    prompts = [repetitive_prompt(s, length=15 + 8 * s) for s in range(3)]
    new_tokens = [24, 24, 24]
    batch = decoder.open_batch()
    try:
        rows = decoder.new_rows(prompts[:2], 24)
        batch.join(rows)
        batch.step()
        rows += decoder.new_rows(prompts[2:], 24)
        batch.join(rows[2:])
        while batch.live:
            batch.step()
    finally:
        batch.close()
    assert [r.result().token_ids for r in rows] == \
        [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens)]
    assert sum(sum(r.stats.accepted_per_step) for r in rows[2:]) > 0


def test_a_cancelled_row_ends_at_the_next_step_and_the_others_go_on(model):
    decoder = LookaheadDecoder(model)
    prompts = [repetitive_prompt(s, length=20) for s in range(3)]
    batch = decoder.open_batch()
    try:
        rows = decoder.new_rows(prompts, 20)
        batch.join(rows)
        batch.step()
        rows[1].cancel()
        ended = batch.step()
        assert rows[1] in ended and rows[1].finish_reason == CANCELLED
        steps = rows[1].stats.steps
        while batch.live:
            batch.step()
    finally:
        batch.close()
    assert rows[1].stats.steps == steps  # nothing decoded for it after
    assert [rows[0].result().token_ids, rows[2].result().token_ids] == \
        [hf_greedy(model, prompts[0], 20), hf_greedy(model, prompts[2], 20)]


def test_an_open_batch_holds_the_decoder_until_it_closes(model):
    decoder = LookaheadDecoder(model)
    batch = decoder.open_batch()
    assert not decoder._lock.acquire(blocking=False)
    batch.close()
    batch.close()  # twice is harmless
    assert decoder._lock.acquire(blocking=False)
    decoder._lock.release()


# -- the scheduler: who joins when, on whose thread ----------------------------------------------

def recorded_steps(monkeypatch):
    """The rows live at each of the batches' steps, as lists of prompt lengths."""
    steps = []
    step = LiveBatch.step

    def spy(self):
        steps.append(sorted(len(r.prompt) for r in self.live))
        return step(self)

    monkeypatch.setattr(LiveBatch, "step", spy)
    return steps


def test_a_request_joins_the_batch_in_flight_at_its_next_step(model, monkeypatch):
    steps = recorded_steps(monkeypatch)
    scheduler = Scheduler(LookaheadDecoder(model), wait_ms=0)
    first = scheduler.submit(repetitive_prompt(1, length=21), {"max_new_tokens": 30})
    scheduler.advance(lambda: False)  # one step: the first request alone
    second = scheduler.submit(repetitive_prompt(2, length=17), {"max_new_tokens": 10})
    scheduler.advance(lambda: False)
    assert steps == [[21], [17, 21]]
    results = scheduler.complete([first, second])
    assert [r.token_ids for r in results] == [hf_greedy(model, repetitive_prompt(1, length=21), 30),
                                              hf_greedy(model, repetitive_prompt(2, length=17), 10)]
    assert scheduler._batch is None and scheduler.decoder._lock.acquire(blocking=False)
    scheduler.decoder._lock.release()


def test_a_request_of_the_other_kind_waits_for_the_batch_to_drain_and_goes_first(
        model, monkeypatch):
    """Greedy and sampled rows batch apart; a sampled request in line stops greedy ones that
    came after it from joining, so neither kind starves."""
    steps = recorded_steps(monkeypatch)
    scheduler = Scheduler(LookaheadDecoder(model), wait_ms=0)
    greedy = {"max_new_tokens": 6}
    sampled = {"max_new_tokens": 6, "do_sample": True, "seed": 3}
    first = scheduler.submit(repetitive_prompt(1, length=21), greedy)
    scheduler.advance(lambda: False)
    other = scheduler.submit(repetitive_prompt(2, length=17), sampled)
    later = scheduler.submit(repetitive_prompt(3, length=13), greedy)
    scheduler.complete([first, other, later])
    assert not any(17 in s and (21 in s or 13 in s) for s in steps)  # never together
    first_of = [next(i for i, s in enumerate(steps) if n in s) for n in (21, 17, 13)]
    assert first_of == sorted(first_of)  # in line: the sampled request before the later one


def test_a_request_the_decoder_refuses_gets_the_error_and_the_others_their_answers(model):
    scheduler = Scheduler(LookaheadDecoder(model), wait_ms=0)
    good = scheduler.submit(repetitive_prompt(1, length=21), {"max_new_tokens": 8})
    bad = scheduler.submit(repetitive_prompt(2, length=17), {"max_new_tokens": 0})
    with pytest.raises(RagSpecError, match="max_new_tokens must be at least 1"):
        scheduler.complete([good, bad])
    assert good.future.result().token_ids == hf_greedy(model, repetitive_prompt(1, length=21), 8)


def test_cancelling_a_queued_request_takes_it_out_of_line(model):
    scheduler = Scheduler(LookaheadDecoder(model), wait_ms=0)
    job = scheduler.submit(repetitive_prompt(1), {"max_new_tokens": 8})
    scheduler.cancel(job)
    assert job.future.result().finish_reason == CANCELLED
    assert scheduler.complete([job])[0].token_ids == []


def test_exclusive_waits_for_the_rows_in_flight_and_lets_none_join(model, monkeypatch):
    steps = recorded_steps(monkeypatch)
    scheduler = Scheduler(LookaheadDecoder(model), wait_ms=0)
    running = scheduler.submit(repetitive_prompt(1, length=21), {"max_new_tokens": 12})
    scheduler.advance(lambda: False)
    with scheduler.exclusive():
        assert running.done  # finished before the block began
        queued = scheduler.submit(repetitive_prompt(2, length=17), {"max_new_tokens": 4})
        assert scheduler._admitted() == [] and not queued.done  # nothing joins meanwhile
    assert queued.future.done() is False
    assert scheduler.complete([queued])[0].token_ids == \
        hf_greedy(model, repetitive_prompt(2, length=17), 4)
    assert all(17 not in s for s in steps[:running.future.result().stats.steps])


# -- LocalLM: streams share the batch ------------------------------------------------------------

def test_streams_share_the_batch_and_each_gets_its_own_text(monkeypatch):
    from conftest import char_lm
    from rag_spec.serving.local_lm import GenerateOptions, LocalLM

    steps = recorded_steps(monkeypatch)
    lm = LocalLM(char_lm(), batch_wait_ms=0)
    options = GenerateOptions(max_new_tokens=24)
    prompts = ["the cat sat on the mat. the cat", "a dog ran far"]
    alone = [c.text for c in lm.generate(prompts, options)]
    steps.clear()
    streams = [lm.stream(p, options) for p in prompts]
    texts = ["", ""]
    done = [None, None]
    while None in done:  # the two consumers take turns on one thread
        for i, stream in enumerate(streams):
            if done[i] is None:
                chunk = next(stream)
                texts[i] += chunk.text
                done[i] = chunk.completion
    assert texts == alone == [c.text for c in done]
    lengths = {len(lm.encode(p)) for p in prompts}
    assert any(set(s) == lengths for s in steps)  # a step decoded both


def test_a_stream_left_early_ends_its_row_and_frees_the_decoder(monkeypatch):
    from conftest import char_lm
    from rag_spec.serving.local_lm import GenerateOptions, LocalLM

    steps = recorded_steps(monkeypatch)
    lm = LocalLM(char_lm(), batch_wait_ms=0)
    stream = lm.stream("the cat sat on the mat. the cat", GenerateOptions(max_new_tokens=200))
    next(stream)
    stream.close()  # the consumer went away
    assert lm._scheduler._batch is None  # its row ended and the batch closed
    assert lm.decoder._lock.acquire(blocking=False)
    lm.decoder._lock.release()
    assert len(steps) < 200


async def test_an_async_stream_left_early_ends_its_row_at_the_next_step(monkeypatch):
    """A client that disconnects mid-stream (the server's ``astream`` closed): its row ends
    at the batch's next step, as "cancelled", while another request goes on."""
    from conftest import char_lm
    from rag_spec.serving.local_lm import GenerateOptions, LocalLM

    steps = recorded_steps(monkeypatch)
    lm = LocalLM(char_lm(), batch_wait_ms=0)
    left = "the cat sat on the mat. the cat"
    stream = lm.astream(left, GenerateOptions(max_new_tokens=200))
    await anext(stream)
    await stream.aclose()  # the client went away
    other = (await lm.agenerate(["a dog ran far"], GenerateOptions(max_new_tokens=12)))[0]
    assert other.text == lm.generate(["a dog ran far"], GenerateOptions(max_new_tokens=12))[0].text
    mine = len(lm.encode(left))
    assert len([s for s in steps if mine in s]) < 200 and mine not in steps[-1]


def test_a_cut_constrained_answer_warns_the_caller_as_generate_does():
    from conftest import char_lm
    from rag_spec import IncompleteOutputWarning
    from rag_spec.serving.local_lm import GenerateOptions, LocalLM

    lm = LocalLM(char_lm(), batch_wait_ms=0)
    options = GenerateOptions(max_new_tokens=3, grammar='root ::= "the cat sat"')
    with pytest.warns(IncompleteOutputWarning, match="Raise max_new_tokens") as caught:
        cut = lm.generate(["the cat"], options)[0]
    assert caught[0].filename == __file__ and cut.incomplete
    with pytest.warns(IncompleteOutputWarning):
        assert "".join(c.text for c in lm.stream("the cat", options)) == cut.text


def test_the_scheduler_gives_back_freed_memory_once_idle(model, monkeypatch):
    import rag_spec.serving.scheduler as scheduler_module

    trims = []
    monkeypatch.setattr(scheduler_module, "_return_free_memory",
                        lambda: trims.append(scheduler._batch))
    scheduler = Scheduler(LookaheadDecoder(model), wait_ms=0)
    first = scheduler.submit(repetitive_prompt(1, length=21), {"max_new_tokens": 4})
    scheduler.advance(lambda: False)
    second = scheduler.submit(repetitive_prompt(2, length=17), {"max_new_tokens": 60})
    scheduler.complete([first])
    assert trims == []  # the first ended while the second decoded
    scheduler.complete([second])
    assert trims == [None]  # once, after the batch closed


def test_a_request_cancelled_while_it_is_admitted_ends_at_its_first_step(model, monkeypatch):
    """Cancelled after it left the line but before its row existed: its row ends at once."""
    scheduler = Scheduler(LookaheadDecoder(model), wait_ms=0)
    job = scheduler.submit(repetitive_prompt(1, length=21), {"max_new_tokens": 40})
    new_rows = scheduler.decoder.new_rows

    def cancelled_meanwhile(*args, **kwargs):
        scheduler.cancel(job)  # neither queued nor running yet
        return new_rows(*args, **kwargs)

    monkeypatch.setattr(scheduler.decoder, "new_rows", cancelled_meanwhile)
    result = scheduler.complete([job])[0]
    assert result.finish_reason == CANCELLED and result.stats.steps <= 1
