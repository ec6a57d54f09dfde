"""Tests for qkv.engine: many sequences at once give each one's reply alone, and every way a request ends."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import model_cfg
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv.engine.engine
from qkv import DecoderLM, DecoderLMConfig, QkvError
from qkv.attention import LatentAttentionConfig, SlidingWindowAttentionConfig
from qkv.engine import Busy, Engine, Finished, Request, StopText, Token
from qkv.generation import Sampling, stream

VOCAB = 40


@functools.cache
def tiny_lm(positions: str = "rotary") -> DecoderLM:
    """A small float32 DecoderLM with grouped-query attention, in eval mode."""
    torch.manual_seed(5)
    cfg = model_cfg(DecoderLMConfig, vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                    max_positions=64, d_ff=64, positions=positions)  # fmt: skip
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        model.embed.tokens.weight.mul_(5)  # peaked logits: sampled tokens vary, greedy ones are well separated
    return model


def alone(model: DecoderLM, ids: list[int], n: int, sampling: Sampling) -> list[int]:
    """The reply generated for one prompt by itself (qkv.generation.stream)."""
    return [int(t[0]) for t in stream(model, torch.tensor([ids]), n, sampling)]


SAMPLINGS = [Sampling(0.0), Sampling(1.0, seed=3), Sampling(0.8, top_k=10, seed=4), Sampling(1.0, top_p=0.9, seed=9)]


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rotary"])
def test_a_batch_of_prompts_gives_each_prompts_reply_alone(positions: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six prompts of lengths 1 to 21 through three slots (so three wait, and enter as others end), read in chunks of
    4: each reply, greedy or sampled with its seed, equals the prompt's reply generated alone (float32: exactly)."""
    monkeypatch.setattr(qkv.engine.engine, "PREFILL_CHUNK", 4)
    model = tiny_lm(positions)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 11, 1, 21, 5, 8)]
    lengths = [15, 4, 9, 12, 15, 6]  # sequences end at different steps, and new ones join mid-flight
    samplings = [SAMPLINGS[i % len(SAMPLINGS)] for i in range(len(prompts))]
    engine = Engine(model, max_batch=3, kv_cache_tokens=3 * 40)
    out = engine.generate([Request(p, n, s) for p, n, s in zip(prompts, lengths, samplings, strict=True)])
    for (tokens, done), p, n, s in zip(out, prompts, lengths, samplings, strict=True):
        assert [t.id for t in tokens] == alone(model, p, n, s)
        assert done == Finished("length", len(p), n, 0)
    assert engine.counts() == {"slots_busy": 0, "slots": 3, "queued": 0}


@pytest.mark.slow
def test_a_compiled_batched_step_gives_each_prompts_reply_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same six prompts through three slots with the decode step compiled (one graph for every batch of rows,
    dynamic in the width they attend over): each reply equals the prompt's reply generated alone, eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(qkv.engine.engine, "PREFILL_CHUNK", 4)
    model = tiny_lm()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 11, 1, 21, 5, 8)]
    lengths = [15, 4, 9, 40, 15, 6]  # the 4th attends past 32 columns: a wider mask, the same compiled step
    samplings = [SAMPLINGS[i % len(SAMPLINGS)] for i in range(len(prompts))]
    engine = Engine(model, max_batch=3, kv_cache_tokens=3 * 64, compiled=True)
    engine.warm_up()  # one row, then two and three (two is the model's key-value heads: a size it could be taken for)
    assert engine.counts()["slots_busy"] == 0 and all(engine.kv.length(row) == 0 for row in range(3))
    with torch._dynamo.config.patch(error_on_recompile=True):  # warmed up: serving compiles nothing more
        out = engine.generate([Request(p, n, s) for p, n, s in zip(prompts, lengths, samplings, strict=True)])
    for (tokens, done), p, n, s in zip(out, prompts, lengths, samplings, strict=True):
        assert [t.id for t in tokens] == alone(model, p, n, s)
        assert done.reason == "length"


def test_log_probabilities_are_those_of_the_models_full_forward_pass() -> None:
    """logprobs=k: each token's log-probability and the k likeliest, as log_softmax of one pass over the text."""
    model = tiny_lm()
    prompt = [1, 2, 3, 4, 5]
    (tokens, _), = Engine(model, max_batch=2).generate([Request(prompt, 6, Sampling(1.0, seed=1), logprobs=3)])
    ids = torch.tensor([prompt + [t.id for t in tokens]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0, len(prompt) - 1 : -1], dim=-1)  # (6, V)
    for i, t in enumerate(tokens):
        assert t.logprob == pytest.approx(float(logp[i, t.id]), abs=1e-5)
        top = torch.topk(logp[i], 3)
        assert [j for j, _ in t.top] == top.indices.tolist()
        assert [p for _, p in t.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_a_prompt_that_starts_like_a_finished_one_reuses_its_slots_keys() -> None:
    """The second request shares 7 tokens with the first's prompt and reply: they are not read again, and the reply
    equals the one read from scratch."""
    model = tiny_lm()
    engine = Engine(model, max_batch=2)
    (first, _), = engine.generate([Request([1, 2, 3, 4, 5], 4, Sampling(0.0))])
    follow = [1, 2, 3, 4, 5, first[0].id, first[1].id, 9, 9]
    (tokens, done), = engine.generate([Request(follow, 5, Sampling(0.0))])
    assert done.cached_tokens == 7
    assert [t.id for t in tokens] == alone(model, follow, 5, Sampling(0.0))


def test_a_stop_token_ends_a_sequence_unsent_and_frees_its_slot() -> None:
    """Greedy decoding stopped at the third token of its reply: two tokens sent, finish_reason stop."""
    model = tiny_lm()
    reply = alone(model, [7, 8], 6, Sampling(0.0))
    stop = reply[2]
    expected = reply[: reply.index(stop)]
    engine = Engine(model, max_batch=1)
    (tokens, done), = engine.generate([Request([7, 8], 6, Sampling(0.0), stop_ids=frozenset({stop}))])
    assert [t.id for t in tokens] == expected
    assert done.reason == "stop" and done.completion_tokens == len(expected) + 1
    assert engine.counts()["slots_busy"] == 0


def test_a_slot_that_fills_ends_its_sequence_with_length() -> None:
    """A slot of 10 tokens: a 6-token prompt gets at most 5 tokens (the last needs no column), then "length"."""
    engine = Engine(tiny_lm(), max_batch=2, kv_cache_tokens=20)
    (tokens, done), = engine.generate([Request([1, 2, 3, 4, 5, 6], 50, Sampling(0.0))])
    assert len(tokens) == 5 and done.reason == "length"


def test_cancelled_and_timed_out_requests_end_and_free_their_slots() -> None:
    """cancel() ends a running request at the next step; a request past the timeout ends as "timeout"."""
    engine = Engine(tiny_lm(), max_batch=1)
    events: list[object] = []
    handle = engine.submit(Request([1, 2, 3], 30, Sampling(0.0)), events.append)
    waiting = engine.submit(Request([4, 5], 30, Sampling(0.0)), events.append)  # queued behind it
    engine.step()
    engine.step()
    handle.cancel()
    waiting.cancel()
    engine.step()
    ends = [e for e in events if isinstance(e, Finished)]
    assert [e.reason for e in ends] == ["cancelled", "cancelled"]
    assert not engine.busy()
    late = Engine(tiny_lm(), max_batch=1, timeout=1e-9)
    (_, done), = late.generate([Request([1, 2, 3], 30, Sampling(0.0))])
    assert done.reason == "timeout"


def test_requests_past_the_queue_cap_are_refused_not_dropped() -> None:
    """One slot and a queue of one: the third request raises Busy; the two accepted ones both finish."""
    engine = Engine(tiny_lm(), max_batch=1, max_queue=1)
    done: list[Finished] = []
    keep = lambda e: done.append(e) if isinstance(e, Finished) else None  # noqa: E731
    engine.submit(Request([1, 2], 3, Sampling(0.0)), keep)  # a free slot will take it
    engine.submit(Request([3, 4], 3, Sampling(0.0)), keep)  # waits
    with pytest.raises(Busy, match="retry shortly"):
        engine.submit(Request([5, 6], 3, Sampling(0.0)), keep)
    while engine.busy():
        engine.step()
    assert [d.reason for d in done] == ["length", "length"]


def test_bad_requests_are_refused_in_one_line() -> None:
    """An empty prompt, a prompt longer than a slot, ids outside the vocabulary, a latent-attention model."""
    engine = Engine(tiny_lm(), max_batch=2, kv_cache_tokens=20)
    with pytest.raises(QkvError, match="prompt is empty"):
        Request([], 5)
    with pytest.raises(QkvError, match="a slot reads 9, with room for the reply"):
        engine.submit(Request(list(range(12)), 5), print)
    with pytest.raises(QkvError, match="out of range"):
        engine.submit(Request([VOCAB + 3], 5), print)
    cfg = model_cfg(DecoderLMConfig, vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=1, max_positions=16,
                    d_ff=64, positions="rotary")  # fmt: skip
    latent = cfg.override({"decoder.block.attention": LatentAttentionConfig(n_heads=4)}).build()
    with pytest.raises(QkvError, match="multi-head or grouped-query attention"):
        Engine(latent.eval(), max_batch=2)


@pytest.mark.parametrize("attention", [LatentAttentionConfig(n_heads=4, kv_lora_rank=8),
                                       SlidingWindowAttentionConfig(n_heads=4, window=6)])  # fmt: skip
def test_one_slot_serves_any_attention_in_the_models_own_cache(attention: object) -> None:
    """One slot keeps the model's own cache (latent, sliding window): replies equal stream's; a prompt that starts
    like the last conversation reads only the rest (a sliding window keeps what its window still holds)."""
    torch.manual_seed(1)
    cfg = model_cfg(DecoderLMConfig, vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_positions=64,
                    d_ff=64, positions="rotary")  # fmt: skip
    model = cfg.override({"decoder.block.attention": attention}).build().eval()
    engine = Engine(model, max_batch=1)
    first, second = [3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    for prompt, sampling in ((first, Sampling(0.0)), (second, Sampling(1.0, seed=2))):
        (tokens, done), = engine.generate([Request(prompt, 10, sampling)])
        assert [t.id for t in tokens] == alone(model, prompt, 10, sampling)
    if isinstance(attention, LatentAttentionConfig):
        assert done.cached_tokens >= 8  # the first prompt, and as much of its reply as the second prompt repeats
    else:
        assert done.cached_tokens == 0  # 17 tokens held: the window of 6 no longer holds the 8th token's past


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_sliding_request_goes_past_the_context_as_stream_does(max_batch: int) -> None:
    """slide=True: at the context's end the last 64 tokens are read again, as stream does, and generation goes on
    (a 60-token prompt, 30 new tokens with a 64-token context); a plain request ends there with "length"."""
    model = tiny_lm()
    prompt = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(model, max_batch=max_batch)
    for sampling in (Sampling(0.0), Sampling(1.0, seed=7)):
        (tokens, done), = engine.generate([Request(prompt, 30, sampling, slide=True)])
        assert [t.id for t in tokens] == alone(model, prompt, 30, sampling) and done.reason == "length"
    (tokens, done), = engine.generate([Request(prompt, 30, Sampling(0.0))])
    assert len(tokens) == 5 and done.reason == "length"  # 60 + 4 keys fill the 64 positions; the 5th is not read


def chars(ids: list[int]) -> str:
    """A decoder whose tokens are characters: id i is chr(97 + i)."""
    return "".join(chr(97 + i) for i in ids)


@settings(max_examples=60, deadline=None)
@given(text=st.text("abc", min_size=1, max_size=20), stops=st.lists(st.text("abc", min_size=1, max_size=3),
                                                                   max_size=3))  # fmt: skip
def test_stop_strings_cut_the_text_at_their_first_appearance(text: str, stops: list[str]) -> None:
    """Sent piece by piece, the text is the full text cut before the first stop string to be completed (all of it
    when none is), whatever the tokens' boundaries: what could begin a stop string waits for the next token.
    Generation stops there, so a stop string that would only end later (overlapping it) never appears."""
    end = next((e for e in range(1, len(text) + 1) if any(s in text[:e] for s in stops)), None)
    cut = len(text) if end is None else min(i for i in (text[:end].find(s) for s in stops) if i >= 0)
    stop = StopText(chars, [], stops)
    sent = ""
    for c in text:
        sent += stop.push(ord(c) - 97)
        if stop.stopped:
            break
    sent += stop.end()
    assert sent == text[:cut]
    assert stop.stopped == (cut < len(text))


def test_text_held_for_a_stop_string_is_sent_when_a_stop_token_ends_the_reply() -> None:
    """The third token's text could begin a stop string, so it is held; the fourth is a stop token: the held text
    comes with Finished, and the reply's text is its first three tokens'."""
    from qkv.tokenizers import CharTokenizer

    tokenizer = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz .,;:!?'-ABCDE"))
    model = tiny_lm()
    prompt = [1, 2, 3]
    sampling = next(s for s in (Sampling(1.0, seed=i) for i in range(50))
                    if len(set(alone(model, prompt, 4, s))) == 4)  # a reply of four different tokens  # fmt: skip
    reply = alone(model, prompt, 6, sampling)
    engine = Engine(model, tokenizer, max_batch=1)
    request = Request(prompt, 6, sampling, stop_ids=frozenset({reply[3]}),
                      stop=[tokenizer.decode([reply[2]]) + "@"])  # fmt: skip
    (tokens, done), = engine.generate([request])
    assert done.reason == "stop" and done.text == tokenizer.decode([reply[2]])
    assert "".join(t.text for t in tokens) + done.text == tokenizer.decode(reply[:3])


def test_engine_events_carry_the_texts_pieces() -> None:
    """With a tokenizer, each Token carries the text it completes; together they are the decoded reply."""
    from qkv.tokenizers import CharTokenizer

    tokenizer = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz .,;:!?'-ABCDE"))
    assert tokenizer.vocab_size <= VOCAB
    (tokens, _), = Engine(tiny_lm(), tokenizer, max_batch=1).generate([Request([1, 2, 3], 8, Sampling(0.0))])
    assert "".join(t.text for t in tokens) == tokenizer.decode([t.id for t in tokens])
    assert all(isinstance(t, Token) for t in tokens)


def test_continuations_are_the_reference_loops_with_seed_plus_k_in_slots_no_larger_than_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`qkv generate --num-samples 3 --seed 5`: sample k is stream's with seed 5 + k, and the slots hold the prompt
    and the reply (8 tokens), not the model's whole context each."""
    from qkv.engine import continuations
    from qkv.tokenizers import CharTokenizer

    engines: list[Engine] = []
    real = Engine.__init__

    def spy(engine: Engine, *args: object, **kwargs: object) -> None:
        real(engine, *args, **kwargs)  # type: ignore[arg-type]
        engines.append(engine)

    monkeypatch.setattr(Engine, "__init__", spy)
    model = tiny_lm()
    tokenizer = CharTokenizer.from_text("".join(chr(0x100 + i) for i in range(VOCAB)))
    assert tokenizer.vocab_size == VOCAB
    samples = continuations(model, tokenizer, [1, 2, 3], 5, Sampling(1.0, seed=5), n=3)
    assert samples == [alone(model, [1, 2, 3], 5, Sampling(1.0, seed=5 + k)) for k in range(3)]
    (engine,) = engines
    assert len(engine.rows) == 3 and engine.kv.capacity == 8
