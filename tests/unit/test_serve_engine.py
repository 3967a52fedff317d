"""The server's engine against the plain model: the slot KV cache reproduces full forwards for
rows of different lengths, and batched decoding chooses what one-at-a-time decoding chooses.

Random models with init_std 0.3 (not 0.02) so their logits are decisive; choices are compared
with the margin rule of tests/helpers.py (fp32 logits of different batch shapes differ by
~1e-6 relative, so only a near tie may part two runs)."""

from __future__ import annotations

import threading

import pytest
import torch

from dtmega.models import Llama, LlamaConfig
from dtmega.models.slot_cache import SlotKVCache
from dtmega.serve.engine import Engine, Sampling, SequenceRequest, wait_all
from dtmega.train.generate import generate_tokens
from tests.helpers import NEAR_TIE

VOCAB = 96


def small_llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    config = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_dim=128, max_seq_len=64,
                         init_std=0.3, rope_theta=10000.0, rope_scaling=None)
    model = Llama(config)
    model.init_weights(seed=seed)
    return model.eval()


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def test_slot_cache_rows_of_different_lengths_match_full_forwards():
    model = small_llama()
    cache = SlotKVCache(slots=4, max_len=64)
    rows = {3: prompts([5])[0], 1: prompts([11], seed=2)[0]}  # slot -> tokens so far
    for slot, tokens in rows.items():  # prefill each alone, into its slot
        cache.select([slot], len(tokens))
        model(torch.tensor([tokens]), position_ids=cache.positions(len(tokens)), cache=cache)
    generator = torch.Generator().manual_seed(3)
    for _ in range(6):  # then decode both together, each row at its own length
        new = torch.randint(0, VOCAB, (2, 1), generator=generator)
        cache.select(list(rows), 1)
        logits = model(new, position_ids=cache.positions(1), cache=cache)[:, -1]
        for i, slot in enumerate(rows):
            rows[slot] = rows[slot] + [int(new[i])]
            reference = model(torch.tensor([rows[slot]]))[0, -1]
            torch.testing.assert_close(logits[i], reference, rtol=1e-5, atol=1e-5)  # fp32, other reduction shapes
    assert cache.lengths.tolist() == [0, 17, 0, 11]
    cache.free(1)
    with pytest.raises(ValueError, match="hold 64 positions; 65 were asked for"):
        cache.select([3], 54)


def run_engine(model: Llama, slots: int = 8) -> tuple[Engine, threading.Thread]:
    engine = Engine(model, vocab_size=VOCAB, slots=slots, max_len=64,
        decode_text=lambda ids: "".join(chr(65 + i % 26) for i in ids))
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    return engine, thread


def stop(engine: Engine, thread: threading.Thread) -> None:
    engine.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()


def assert_same_tokens(batched, alone) -> None:
    """Same tokens, unless they part at a near tie of the one-at-a-time run."""
    for step, (x, y) in enumerate(zip(batched.ids + [None], alone.ids + [None])):
        if x != y:
            assert alone.margins[step] < NEAR_TIE, f"parted at token {step} ({x} vs {y}), margin {alone.margins[step]:.2e}"
            return


def test_batched_requests_choose_what_one_at_a_time_decoding_chooses():
    model = small_llama()
    engine, thread = run_engine(model)
    try:
        ids = prompts([3, 9, 5, 14, 1])
        settings = [Sampling(max_new_tokens=12, temperature=0.0),
                    Sampling(max_new_tokens=12, temperature=0.9, top_k=20, seed=7),
                    Sampling(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=8),
                    Sampling(max_new_tokens=7, temperature=0.0),
                    Sampling(max_new_tokens=12, temperature=1.3, seed=9)]
        results = wait_all(engine, [SequenceRequest(i, p, s) for i, (p, s) in enumerate(zip(ids, settings))], timeout=60)
        assert engine.forwards < sum(len(r.ids) for r in results)  # decoded together
        for prompt, sampling, result in zip(ids, settings, results):
            alone = generate_tokens(model, prompt, vocab_size=VOCAB, eod=None, max_new_tokens=sampling.max_new_tokens,
                                    temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                    seed=sampling.seed)
            assert_same_tokens(result, alone)
            assert result.finish_reason == "length" and len(result.ids) == sampling.max_new_tokens
            # logprobs: the model's log-softmax at the chosen tokens, from a full forward
            with torch.no_grad():
                logits = model(torch.tensor([prompt + result.ids]))[0, len(prompt) - 1:-1]
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(result.ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(result.logprobs), expected, rtol=1e-4, atol=1e-4)
    finally:
        stop(engine, thread)


def test_prompt_logprobs_top_logprobs_and_zero_new_tokens():
    model = small_llama()
    engine, thread = run_engine(model)
    try:
        prompt = prompts([10])[0]
        result, = wait_all(engine, [SequenceRequest(0, prompt, Sampling(max_new_tokens=0, prompt_logprobs=True,
                                                                         top_logprobs=3))], timeout=30)
        with torch.no_grad():
            log_probs = model(torch.tensor([prompt]))[0, :-1].log_softmax(-1)
        expected = log_probs.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.prompt_logprobs), expected, rtol=1e-4, atol=1e-4)
        assert result.ids == [] and result.finish_reason == "length"
        first_top = result.prompt_top_logprobs[0]
        assert list(first_top) == log_probs[0].topk(3).indices.tolist()
    finally:
        stop(engine, thread)


def test_stop_token_stop_strings_queueing_and_cancellation_free_their_slots():
    model = small_llama()
    engine, thread = run_engine(model, slots=2)
    try:
        prompt = prompts([4])[0]
        greedy, = wait_all(engine, [SequenceRequest(0, prompt, Sampling(max_new_tokens=10, temperature=0.0))])
        stop_at = greedy.ids[3]
        cut = greedy.ids.index(stop_at)
        by_token, = wait_all(engine, [SequenceRequest(1, prompt, Sampling(max_new_tokens=10, temperature=0.0,
                                                                           stop_token=stop_at))])
        assert by_token.ids == greedy.ids[:cut] and by_token.finish_reason == "stop"
        text = "".join(chr(65 + i % 26) for i in greedy.ids)
        by_string, = wait_all(engine, [SequenceRequest(2, prompt, Sampling(max_new_tokens=10, temperature=0.0,
                                                                            stop_strings=(text[4:6],)))])
        assert by_string.finish_reason == "stop" and len(by_string.ids) <= 6
        # five sequences on two slots: they wait their turn, and all finish
        many = wait_all(engine, [SequenceRequest(10 + i, p, Sampling(max_new_tokens=5, temperature=0.0))
                                 for i, p in enumerate(prompts([2, 3, 4, 5, 6]))], timeout=60)
        assert [len(r.ids) for r in many] == [5] * 5
        # a long sequence cancelled mid-way ends "cancelled" and gives its slot back
        cancelled = wait_all(engine, [SequenceRequest(20, prompt, Sampling(max_new_tokens=59, temperature=0.0))],
                             timeout=0.05)[0]
        assert cancelled.finish_reason in ("cancelled", "length")
        assert engine.load()["running"] == 0 and sorted(engine._free_slots) == [0, 1]
    finally:
        stop(engine, thread)


def test_one_sequences_failure_ends_that_sequence_only_and_frees_its_slot():
    """Matrix 3, H1/H22: an exception while one sequence joined or prefilled (an overflowing seed,
    a failed allocation) ended every running request with 500 and leaked the sequence's slot;
    33 of them and the server never generated again. Now the failing sequence alone ends with
    the error, the others finish as if alone, and every slot comes back."""
    model = small_llama()
    engine, thread = run_engine(model, slots=4)
    try:
        good = [SequenceRequest(i, p, Sampling(max_new_tokens=6, temperature=0.0)) for i, p in enumerate(prompts([5, 7]))]
        too_long = SequenceRequest(9, prompts([70])[0], Sampling(max_new_tokens=2))  # past the 64-position slots
        huge_seed = SequenceRequest(10, prompts([4])[0], Sampling(max_new_tokens=3, seed=2**70))
        results = wait_all(engine, [*good, too_long, huge_seed], timeout=120)
        assert results[2].finish_reason == "error" and "70 were asked for" in results[2].error
        assert results[3].finish_reason == "length" and len(results[3].ids) == 3  # reduced modulo 2^64, as torch takes
        for request, result in zip(good, results[:2]):
            alone = generate_tokens(model, request.prompt_ids, vocab_size=VOCAB, eod=None, max_new_tokens=6,
                                    temperature=0.0)
            assert result.finish_reason == "length"
            assert_same_tokens(result, alone)
        assert engine.load()["free_slots"] == 4 and engine.load()["running"] == 0
    finally:
        stop(engine, thread)


def test_a_prefill_computes_the_last_positions_logits_only():
    """Matrix 3, H22: [B, S, V] logits were computed for every prompt position and sliced after
    (24.8 GB for 32 x 4,000 positions of a 50,000-word vocabulary). Without prompt logprobs, the
    output layer now sees one position per row; with them, every position."""
    model = small_llama()
    seen: list[tuple[int, ...]] = []
    model.output.register_forward_hook(lambda module, inputs, output: seen.append(tuple(output.shape)))
    engine, thread = run_engine(model, slots=2)
    try:
        wait_all(engine, [SequenceRequest(0, prompts([9])[0], Sampling(max_new_tokens=1, temperature=0.0))])
        assert seen[0] == (1, 1, VOCAB)
        seen.clear()
        wait_all(engine, [SequenceRequest(1, prompts([9])[0], Sampling(max_new_tokens=1, prompt_logprobs=True))])
        assert seen[0] == (1, 9, VOCAB)
    finally:
        stop(engine, thread)


def test_a_stream_whose_client_stops_reading_is_cancelled_at_its_deadline():
    """Matrix 3, H18: a client that never reads blocks the send of a chunk, where the stream's own
    deadline check never runs: its sequences (all the slots) ran on past --request-timeout. A
    watchdog now cancels them at the deadline whatever the stream is doing. Here the stream is
    advanced once and then never again, as a blocked send leaves it."""
    import asyncio
    from types import SimpleNamespace

    from dtmega.serve import app as serve_app

    class Engine:
        def __init__(self):
            self.cancelled: list[int] = []

        def submit(self, request, on_done, on_token=None):
            on_token(request.id, 1)

        def cancel(self, ids):
            self.cancelled += ids

    class Client:
        async def is_disconnected(self):
            return False

    engine = Engine()
    parsed = SimpleNamespace(model="m", n=1, include_usage=False, sampling=SimpleNamespace(stop_strings=()))
    sequences = [SequenceRequest(i, [1], Sampling(max_new_tokens=100)) for i in range(3)]
    tokenizer = SimpleNamespace(decode=lambda ids: "x" * len(ids))

    async def scenario():
        stream = serve_app._stream(engine, parsed, sequences, Client(), 0.3, tokenizer,
                                   serve_app._completion_stream(parsed, "cmpl-1"))
        await stream.__anext__()  # the first chunk is sent; the next send never completes
        await asyncio.sleep(0.8)
        return list(engine.cancelled)

    assert sorted(asyncio.run(scenario())) == [0, 1, 2]


def test_a_lost_peer_rank_ends_every_sequence_as_unavailable_and_stops_in_one_line():
    """Matrix 3, H24: a tensor-parallel rank killed mid-request gave the requests in flight 500s
    naming gloo and the server a raw traceback. A broken collective is the server's failure, not a
    sequence's: every running and waiting sequence ends "server unavailable" (HTTP 503), health
    says broken, and run() raises one DistributedTimeout line. The peer's death is simulated by
    the forward raising gloo's words."""
    from dtmega.joining import DistributedTimeout
    from dtmega.serve.app import _failure_status
    from dtmega.serve.engine import UNAVAILABLE

    model = small_llama()
    forward = model.forward
    calls = [0]

    def breaking(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")
        return forward(*args, **kwargs)

    model.forward = breaking
    engine = Engine(model, vocab_size=VOCAB, slots=1, max_len=64, decode_text=lambda ids: "")
    results = {}
    for i, prompt in enumerate(prompts([4, 5])):  # the second waits for the one slot
        engine.submit(SequenceRequest(i, prompt, Sampling(max_new_tokens=20, temperature=0.0)),
                      lambda result: results.__setitem__(result.id, result))
    with pytest.raises(DistributedTimeout, match=r"rank 0: a rank of this server went away .* Connection reset by "
                                                 r"peer\. Fix: look at that rank's logs"):
        engine.run()
    assert sorted(results) == [0, 1] and all(r.error.startswith(UNAVAILABLE) for r in results.values())
    assert _failure_status(results[1].error) == 503 and engine.broken


def test_a_prefill_takes_at_most_its_token_budget_per_forward(monkeypatch):
    """Matrix 3, H22: n 32 x 4,000-token prompts went through one forward. Rows of one length are
    now prefilled PREFILL_TOKENS at a time (here 10: two 5-token prompts per forward), with the
    same tokens as one forward would choose."""
    from dtmega.serve import engine as engine_module

    model = small_llama()
    seen: list[int] = []
    model.output.register_forward_hook(lambda module, inputs, output: seen.append(output.shape[0]))
    monkeypatch.setattr(engine_module, "PREFILL_TOKENS", 10)
    engine = Engine(model, vocab_size=VOCAB, slots=4, max_len=64, decode_text=lambda ids: "")
    requests = [SequenceRequest(i, p, Sampling(max_new_tokens=1, temperature=0.0))
                for i, p in enumerate(prompts([5, 5, 5], seed=4))]
    results: dict[int, object] = {}
    for request in requests:  # all waiting before the engine runs: one step takes the three
        engine.submit(request, lambda result: results.__setitem__(result.id, result))
    engine.stop()  # finishes what was submitted, then returns
    engine.run()
    assert seen == [2, 1]  # prefills of 2 rows, then 1; one token each, so no decode
    for request in requests:
        alone = generate_tokens(model, request.prompt_ids, vocab_size=VOCAB, eod=None, max_new_tokens=1,
                                temperature=0.0)
        assert_same_tokens(results[request.id], alone)


def test_a_stream_send_that_blocks_ends_at_the_deadline():
    """Matrix 3, H18, the connection's side: a client that never reads left the stream's send
    blocked, the connection held and a stop waiting uvicorn's whole graceful timeout. Each send is
    now bounded by the deadline (+1 s): the response ends and uvicorn closes the connection."""
    import asyncio
    import time

    from dtmega.serve.app import DeadlineStreamingResponse

    async def events():
        while True:
            yield "data: x\n\n"

    sent: list[dict] = []

    async def send(message):  # the start and the first chunk go out, then the client stops reading
        sent.append(message)
        if len(sent) > 2:
            await asyncio.Event().wait()

    async def scenario():
        started = time.monotonic()
        await DeadlineStreamingResponse(events(), 0.5, media_type="text/event-stream").stream_response(send)
        return time.monotonic() - started

    took = asyncio.run(scenario())
    assert 1.4 < took < 5.0 and len(sent) == 3, (took, len(sent))


def test_a_stop_waits_for_the_calls_in_flight_not_for_clients_that_stopped_reading():
    """Matrix 3, H18, the stop: a client that stopped reading keeps its connection's unsent bytes,
    and uvicorn's stop waited its whole graceful timeout (--request-timeout, 20 s) for that
    connection to close. The stop now waits for the application's calls in flight (a stream
    counts until its last event), then FLUSH_SECONDS for readers, then stops waiting."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from dtmega.serve.shutdown import CallsInFlight, stop_when_answered

    release = threading.Event()

    async def app(scope, receive, send):  # a stream still being answered until `release`
        while not release.is_set():
            await asyncio.sleep(0.01)

    calls = CallsInFlight(app)
    loop_done = threading.Event()
    threading.Thread(target=lambda: (asyncio.run(calls({"type": "http"}, None, None)), loop_done.set()),
                     daemon=True).start()
    deadline = time.monotonic() + 5
    while calls.count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.count == 1
    server = SimpleNamespace(force_exit=False)
    started = time.monotonic()
    watcher = stop_when_answered(server, calls, limit_seconds=30, flush_seconds=0.2)
    time.sleep(0.5)
    assert not server.force_exit, "the stop did not wait for the answer in flight"
    release.set()
    watcher.join(timeout=10)
    assert loop_done.wait(5) and calls.count == 0 and server.force_exit
    assert time.monotonic() - started < 10  # not the 30 s limit: the answer ended, its reader is not waited for
    lifespan = CallsInFlight(app)
    release.set()
    asyncio.run(lifespan({"type": "lifespan"}, None, None))  # not an HTTP call: not counted
    assert lifespan.count == 0
