"""A load test of `dtmega serve` (issue 48, must-show 2): 200 concurrent requests on loopback,
a third of them hostile (the reliability matrix's H rows: seeds past int64, nesting, lone
surrogates, 1e-300 temperatures, oversized stop strings, prompts past the context, clients that
hang up mid-stream, bodies that never finish), while well-formed greedy clients keep getting the
server's own greedy answer within a stated bound and health stays truthful.

Bounds (this 2-core CPU machine, the tiny checkpoint, 16 client threads): every well-formed
answer within LATENCY_S (a request waits at most for the 32 slots' worth of queued work ahead of
it; a few seconds is typical), every health probe within HEALTH_S (a loop blocked by
a render or a body would hold it 10 s or more), the whole test within a few tens of seconds."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from dtmega.serve.process import ServerProcess

REQUESTS = 200
LATENCY_S = 60.0  # a well-formed request's answer, queueing included, on 2 busy cores
HEALTH_S = 5.0  # a health probe while the load runs (it never waits for generation; a blocked loop: 10 s+)
GREEDY = {"prompt": "In the beginning", "max_tokens": 8, "temperature": 0}


def _decisive_greedy_text(checkpoint) -> str:
    """The greedy continuation of GREEDY's prompt, computed in this process, after checking that
    no step of it is a near tie (tests/helpers.py): batched with other requests, fp32 logits move
    by ~1e-6 relative, so only a decisive continuation may be asserted under any batching."""
    from dtmega.train.generate import generate_tokens
    from dtmega.train.restore import restore
    from tests.helpers import NEAR_TIE

    pm, tokenizer, _ = restore(checkpoint)
    generation = generate_tokens(pm.module.eval(), tokenizer.encode(GREEDY["prompt"]), vocab_size=tokenizer.vocab_size,
                                 eod=tokenizer.eod, max_new_tokens=GREEDY["max_tokens"], temperature=0.0)
    assert min(generation.margins) > 10 * NEAR_TIE, generation.margins  # the precondition, not luck
    return tokenizer.decode(generation.ids)


def _hostile(server: ServerProcess, kind: str) -> tuple[str, bool]:
    """Sends one hostile request; (kind, whether the server answered it as the matrix says)."""
    if kind == "seed":
        status, _ = server.request("POST", "/v1/completions", {**GREEDY, "seed": 2**70})
        return kind, status == 400
    if kind == "nesting":
        status, _ = server.request("POST", "/v1/completions", b"[" * 3000)
        return kind, status == 400
    if kind == "surrogate":
        status, _ = server.request("POST", "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}')
        return kind, status == 400
    if kind == "tiny_temperature":
        status, body = server.api({"prompts": ["In the"], "tokens_to_generate": 4, "temperature": 1e-300,
                                   "stop_token": -1})
        return kind, status == 200 and max(body["tokens"][0]) < 258
    if kind == "stop":
        status, _ = server.request("POST", "/v1/completions", {**GREEDY, "stop": ["x" * 5000] * 4})
        return kind, status == 400
    if kind == "too_long":
        status, _ = server.api({"prompts": ["x" * 500], "tokens_to_generate": 4})
        return kind, status == 400
    if kind == "hang_up":  # reads one event of a stream, then leaves
        request = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                         data=json.dumps({**GREEDY, "max_tokens": 60, "n": 4, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            ok = response.status == 200 and response.readline().startswith(b"data: ")
        return kind, ok
    if kind == "unfinished_body":  # announced 100 bytes, sent 6: answered 408 at the body deadline
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as connection:
            connection.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
            answer = connection.recv(64)
        return kind, answer.startswith(b"HTTP/1.1 408")
    raise ValueError(kind)


def test_two_hundred_mixed_requests_leave_well_formed_clients_correct_and_health_truthful(tiny_checkpoint):
    server = ServerProcess(["--load", str(tiny_checkpoint), "--request-timeout", "3"])
    try:
        expected = _decisive_greedy_text(tiny_checkpoint)
        status, reference = server.request("POST", "/v1/completions", GREEDY)
        assert status == 200 and reference["choices"][0]["text"] == expected
        kinds = ["seed", "nesting", "surrogate", "tiny_temperature", "stop", "too_long", "hang_up", "unfinished_body"]
        rng = random.Random(0)
        plan = ["good" if i % 3 else kinds[(i // 3) % len(kinds)] for i in range(REQUESTS)]
        rng.shuffle(plan)
        health_times: list[float] = []
        health_states: list[str] = []
        done = threading.Event()

        def probe():
            while not done.is_set():
                started = time.monotonic()
                health_states.append(server.health()["status"])
                health_times.append(time.monotonic() - started)
                time.sleep(0.2)

        def one(kind: str):
            if kind != "good":
                return _hostile(server, kind)
            started = time.monotonic()
            status, body = server.request("POST", "/v1/completions", GREEDY, timeout=LATENCY_S + 30)
            took = time.monotonic() - started
            return "good", status == 200 and body["choices"][0]["text"] == expected and took < LATENCY_S

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(one, plan))
        done.set()
        prober.join(10)
        failed = [kind for kind, ok in outcomes if not ok]
        assert not failed, failed
        assert sum(kind == "good" for kind, _ in outcomes) >= 130
        assert health_states and set(health_states) == {"ok"} and max(health_times) < HEALTH_S, (
            max(health_times), set(health_states))
        load = server.health()
        assert time.monotonic() - started < 300
        assert load["running"] == 0 and load["waiting"] == 0 and load["free_slots"] == load["slots"], load
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
