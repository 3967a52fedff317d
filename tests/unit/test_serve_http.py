"""`dtmega serve` over real HTTP on loopback: the seeds' curl command, Megatron's /api against
`dtmega generate` and the model's own log-probabilities, every bad request a 400 (and the server
still answering), OpenAI completions and their streams (through the official `openai` client),
batching, a client that leaves (a request or a stream), timeouts, SIGTERM draining, and a
tensor-parallel server answering like a one-rank server."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading

import pytest
import torch

from dtmega.serve.process import ServerProcess, wait_until
from dtmega.train import generate as generate_cli
from dtmega.train.generate import generate_tokens
from dtmega.train.restore import restore
from tests.helpers import NEAR_TIE

PROMPT = "In the beginning"
LIMIT = 4096  # the test server's --max-request-bytes


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    process = ServerProcess(["--load", str(tiny_checkpoint), "--max-request-bytes", str(LIMIT)])
    yield process
    assert process.stop() == 0, "".join(process.lines)[-3000:]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    pm, tokenizer, _ = restore(tiny_checkpoint)
    return pm.module.eval(), tokenizer


def test_the_seeds_curl_command_works(server):
    if shutil.which("curl") is None:  # the same request without curl
        status, body = server.api({"prompts": ["Hello world"], "tokens_to_generate": 1})
        assert status == 200 and len(body["text"]) == 1
        return
    done = subprocess.run(["curl", "-s", f"{server.url}/api", "-X", "PUT", "-H",
                           "Content-Type: application/json; charset=UTF-8", "-d",
                           '{"prompts":["Hello world"], "tokens_to_generate":1}'],
                          capture_output=True, text=True, timeout=60, check=True)
    body = json.loads(done.stdout)
    # one token is sampled (temperature 1): it may be the end of document, which ends the sequence unshown
    assert body["text"][0].startswith("Hello world") and body["tokens"][0][:11] == list(b"Hello world")
    assert len(body["tokens"][0]) in (11, 12) and len(body["segments"][0]) == len(body["tokens"][0])
    assert body["segments"][0][:5] == list("Hello") and body["logprobs"] is None


def test_greedy_api_equals_dtmega_generate_and_logprobs_are_the_models(server, model, tiny_checkpoint):
    module, tokenizer = model
    status, body = server.api({"prompts": [PROMPT], "tokens_to_generate": 24, "top_k": 1, "logprobs": True})
    assert status == 200
    printed = generate_cli.main(["--load", str(tiny_checkpoint), "--prompt", PROMPT, "--max-new-tokens", "24", "--greedy"])
    reference = generate_tokens(module, tokenizer.encode(PROMPT), vocab_size=tokenizer.vocab_size, eod=tokenizer.eod,
                                max_new_tokens=24, temperature=0.0)
    assert printed == tokenizer.decode(reference.ids)
    prompt_ids = tokenizer.encode(PROMPT)
    served = body["tokens"][0][len(prompt_ids):]
    if served == reference.ids:
        assert body["text"][0] == PROMPT + printed
    else:  # only a near tie may part them (the server's batched attention rounds differently)
        step = next(i for i, (x, y) in enumerate(zip(served + [None], reference.ids + [None])) if x != y)
        assert reference.margins[step] < NEAR_TIE, f"parted at token {step}, margin {reference.margins[step]:.2e}"
    tokens = body["tokens"][0]
    with torch.no_grad():
        log_probs = module(torch.tensor([tokens]))[0, :-1].float()
    log_probs[:, tokenizer.vocab_size:] = float("-inf")
    expected = log_probs.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    assert len(body["logprobs"][0]) == len(tokens) - 1
    torch.testing.assert_close(torch.tensor(body["logprobs"][0]), expected, rtol=1e-4, atol=1e-4)  # fp32 roundoff
    assert body["segments"][0] == [tokenizer.decode([t]) for t in tokens]


BAD_REQUESTS = [
    ({"tokens_to_generate": 4}, "prompts argument required"),
    ({"prompts": ["x"] * 129}, "Maximum number of prompts is 128"),
    ({"prompts": ["x"], "temperature": 0}, "temperature must be a positive number less than or equal to 100.0"),
    ({"prompts": ["x"], "temperature": 101}, "temperature must be a positive number less than or equal to 100.0"),
    ({"prompts": ["x"], "top_k": 5, "top_p": 0.9}, "cannot set both top-k and top-p samplings."),
    ({"prompts": ["x"], "top_k": 1001}, "top_k must be equal to or greater than 0 and less than or equal to 1000"),
    ({"prompts": ["x"], "top_p": 1.5}, "top_p must be less than or equal to 1.0"),
    (b"prompts: [x]", "the request body is not JSON"),
    (b'{"prompts": ["' + b"x" * LIMIT + b'"]}', f"exceeds the server's limit of {LIMIT} bytes"),
    ({"prompts": ["x" * 10], "tokens_to_generate": 200},
     ("the prompt (10 tokens) + tokens_to_generate 200 = 210 tokens exceeds the server's context of 128 tokens. "
      "Fix: tokens_to_generate 118 or less")),
    ({"prompts": ["x" * 130], "tokens_to_generate": 4},
     "the prompt has 130 tokens, but the server's context holds 128 tokens, the generated ones included. "
     "Fix: a prompt of at most 127 tokens"),
    ({"prompts": "x"}, "prompts is not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
    ({"prompts": ["x"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
    ({"prompts": ["x"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer greater than or equal to 0"),
    ({"prompts": ["x"], "logprobs": "yes"}, "logprobs must be a boolean value"),
    ({"prompts": ["x"], "random_seed": -3}, "random_seed must be a positive integer"),
    ({"prompts": ["x"], "stop_token": "eos"}, "stop_token must be an integer"),
    ({"sentences": ["x"], "prompts": ["x"]}, "sentences is no longer used.  Replace with prompts"),
    ({"prompts": ["x"], "beam_width": 2}, "beam_width=2 is not supported by dtmega serve. Fix: leave beam_width out"),
    # matrix-2 N32 and N36: bytes that are not UTF-8, and values JSON allows but that mean nothing
    (b'{"prompts": ["\xff\xfe"]}', "the request body is not JSON"),
    (b'{"prompts": ["x"], "temperature": NaN}', "temperature must be a positive number less than or equal to 100.0"),
    (b'{"prompts": ["x"], "temperature": Infinity}', "temperature must be a positive number less than or equal to 100.0"),
    (b'{"prompts": ["x"], "top_p": NaN}', "top_p must be less than or equal to 1.0"),
    ({"prompts": ["x"], "tokens_to_generate": 4.5}, "tokens_to_generate must be an integer greater than 0"),
    ({"prompts": ["x"], "tokens_to_generate": True}, "tokens_to_generate must be an integer greater than 0"),
    ({"prompts": ["x"], "top_k": 1e9}, "top_k must be an integer equal to or greater than 0"),
    ({"prompts": ["x"], "random_seed": 1e300}, "random_seed must be integer"),
    # matrix 3: H1 (a seed past int64 failed other clients' requests), H4 (nesting: a raw 500), H6 (a lone surrogate)
    ({"prompts": ["x"], "random_seed": 2**70}, "random_seed must be at most 9223372036854775807"),
    (b"[" * 4000, "the request body is not JSON (nested too deeply)"),
    (b'{"prompts": ["a\\ud800b"]}', "prompts[0] holds the lone surrogate"),
]


@pytest.mark.parametrize("body,message", BAD_REQUESTS, ids=[m[:40] for _, m in BAD_REQUESTS])
def test_bad_requests_get_400_with_megatrons_message_and_the_server_still_answers(server, body, message):
    status, answer = server.api(body)
    assert status == 400 and message in answer["message"], answer
    assert server.health()["status"] == "ok"
    status, answer = server.api({"prompts": ["ok"], "tokens_to_generate": 2, "stop_token": -1})
    assert status == 200 and len(answer["tokens"][0]) == 4


@pytest.mark.parametrize("field, value", [("n", 1000), ("logprobs", 1_000_000), ("stop", ["a", "b", "c", "d", "e", "f"]),
                                          ("seed", 1e300), ("max_tokens", 4.5),
                                          ("seed", 2**64), ("stop", ["y" * 1001]),  # matrix 3, H1 and H2
                                          ("stop", ""), ("stop", [""])])  # H3 (held)
def test_openai_values_that_mean_nothing_get_400_naming_the_field(server, field, value):
    """Matrix-2 N36, OpenAI's side: each refused with its own message, `param` naming the field."""
    status, error = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, field: value})
    assert status == 400 and error["error"]["param"] == field, error
    assert server.health()["status"] == "ok"


def test_routing_errors_answer_in_megatrons_shape(server):
    """POST /api (Megatron's clients PUT) answers 405 with Megatron's {"message": ...}, not FastAPI's
    {"detail": ...}; an unknown path 404 the same way."""
    status, body = server.request("POST", "/api", {"prompts": ["x"]})
    assert (status, body) == (405, {"message": "The method is not allowed for the requested URL."})
    status, body = server.request("GET", "/nowhere")
    assert status == 404 and body["message"].startswith("The requested URL was not found")


def test_sampling_is_reproducible_by_random_seed_and_add_bos_prepends_the_eod(server, model):
    _, tokenizer = model
    body = {"prompts": [PROMPT, PROMPT], "tokens_to_generate": 12, "temperature": 1.0, "top_p": 0.9,
            "random_seed": 5, "stop_token": -1, "add_BOS": True}
    first, second = server.api(body)[1], server.api(body)[1]
    assert first["tokens"] == second["tokens"]
    assert first["tokens"][0] != first["tokens"][1]  # prompt i draws from seed + i
    assert first["tokens"][0][0] == tokenizer.eod and len(first["tokens"][0]) == 1 + len(PROMPT) + 12


def test_openai_completions_and_health(server):
    status, body = server.request("POST", "/v1/completions", {
        "prompt": [PROMPT, "And"], "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True, "n": 2, "seed": 1})
    assert status == 200 and body["object"] == "text_completion" and len(body["choices"]) == 4
    first = body["choices"][0]
    assert first["text"].startswith(PROMPT) and first["finish_reason"] in ("length", "stop")
    assert first["text"] == body["choices"][1]["text"]  # greedy: both completions of a prompt agree
    lp = first["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(PROMPT) + 6
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:]) and lp["text_offset"][:3] == [0, 1, 2]
    assert body["usage"] == {"prompt_tokens": len(PROMPT) + 3, "completion_tokens": 24,
                             "total_tokens": len(PROMPT) + 3 + 24}
    completion = first["text"][len(PROMPT):]
    if len(completion) > 2:
        stop = completion[1:3]
        cut = server.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                          "stop": stop})[1]["choices"][0]
        assert cut["text"] == completion[:completion.index(stop)] and cut["finish_reason"] == "stop"
    status, error = server.request("POST", "/v1/completions", {"prompt": PROMPT, "top_p": 0})
    assert status == 400 and error["error"]["param"] == "top_p"
    status, error = server.request("POST", "/v1/completions", {"prompt": PROMPT, "stream": True, "logprobs": 1})
    assert status == 400 and error["error"]["param"] == "logprobs" and "in a stream" in error["error"]["message"]
    status, error = server.request("POST", "/v1/completions", {"prompt": PROMPT, "stream": "yes"})
    assert status == 400 and error["error"]["param"] == "stream"
    status, error = server.request("POST", "/v1/completions", {"prompt": "x" * 130, "max_tokens": 4})
    assert status == 400 and error["error"]["param"] == "prompt" and "at most 127 tokens" in error["error"]["message"]
    status, error = server.request("POST", "/v1/completions", {"prompt": "x" * 100, "max_tokens": 40})
    assert status == 400 and error["error"]["param"] == "max_tokens" and "max_tokens 28 or less" in error["error"]["message"]
    status, error = server.request("GET", "/v1/completions")
    assert status == 405 and error["error"]["type"] == "invalid_request_error"
    assert server.request("GET", "/v1/models")[1]["data"][0]["id"] == "checkpoints"
    health = server.health()
    assert health["status"] == "ok" and health["slots"] == 32 and health["running"] == 0


def _streamed(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    return texts, finish, usage


def test_the_openai_client_streams_completions_that_equal_the_whole_answer(server):
    """The official `openai` package with stream=True (server-sent events): for the same seed the
    concatenated chunks of every choice equal the non-streamed text, finish reasons and usage
    agree, and a stop string is never sent, not even in part."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="checkpoints", prompt=[PROMPT, "And"], max_tokens=12, temperature=0.9, top_p=0.95, seed=3, n=2)
    whole = client.completions.create(**kwargs)
    texts, finish, usage = _streamed(client.completions.create(**kwargs, stream=True,
                                                               stream_options={"include_usage": True}))
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 4
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    greedy = client.completions.create(model="checkpoints", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    if len(greedy) > 4:
        stop = greedy[2:4]
        cut = client.completions.create(model="checkpoints", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
        texts, finish, _ = _streamed(client.completions.create(model="checkpoints", prompt=PROMPT, max_tokens=12,
                                                               temperature=0, stop=stop, stream=True))
        assert texts[0] == cut.choices[0].text == greedy[:greedy.index(stop)] and finish[0] == "stop"
    assert server.health()["running"] == 0


def test_a_client_that_leaves_a_stream_frees_its_slots(server):
    before = server.health()["generated_tokens"]
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": ["x"] * 16, "max_tokens": 120, "stream": True}).encode()
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert connection.recv(4096).startswith(b"HTTP/1.1 200")  # the stream started
        assert wait_until(lambda: server.health()["running"] > 0, every=0.01)
    assert wait_until(lambda: server.health()["running"] + server.health()["waiting"] == 0, timeout=10)
    assert server.health()["generated_tokens"] - before < 16 * 120  # stopped early, slots free


def test_concurrent_requests_decode_together(server):
    before = server.health()
    answers: list = []

    def ask(i: int) -> None:
        answers.append(server.api({"prompts": [f"{i} {PROMPT}"], "tokens_to_generate": 24, "stop_token": -1}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [status for status, _ in answers] == [200] * 8
    after = server.health()
    tokens = after["generated_tokens"] - before["generated_tokens"]
    forwards = after["forwards"] - before["forwards"]
    assert tokens == 8 * 24 and forwards < tokens / 2, (tokens, forwards)


def test_a_client_that_disconnects_has_its_sequences_cancelled(server):
    before = server.health()["generated_tokens"]
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompts": ["x"] * 128, "tokens_to_generate": 120, "stop_token": -1}).encode()
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: server.health()["running"] > 0, every=0.01)
    assert wait_until(lambda: server.health()["running"] + server.health()["waiting"] == 0, timeout=10)
    assert server.health()["generated_tokens"] - before < 128 * 120  # stopped early, slots free


@pytest.fixture(scope="module")
def one_slot_server(tiny_checkpoint):
    process = ServerProcess(["--load", str(tiny_checkpoint), "--max-batch-size", "1", "--request-timeout", "2"])
    yield process
    process.kill()


def test_a_request_past_its_timeout_gets_504_and_its_queued_sequences_are_dropped(one_slot_server):
    status, body = one_slot_server.api({"prompts": ["x"] * 128, "tokens_to_generate": 100, "stop_token": -1})
    assert status == 504 and "--request-timeout of 2 s" in body["message"]
    assert wait_until(lambda: one_slot_server.health()["running"] + one_slot_server.health()["waiting"] == 0)
    assert one_slot_server.api({"prompts": ["x"], "tokens_to_generate": 2})[0] == 200


def test_sigterm_finishes_the_requests_in_flight_then_exits(one_slot_server):
    answers: list = []
    ask = threading.Thread(target=lambda: answers.append(
        one_slot_server.api({"prompts": ["x"] * 2, "tokens_to_generate": 100, "stop_token": -1})))
    ask.start()
    assert wait_until(lambda: one_slot_server.health()["running"] == 1, every=0.005)
    one_slot_server.process.send_signal(15)
    ask.join(30)
    status, body = answers[0]
    assert status == 200 and [len(t) for t in body["tokens"]] == [101] * 2
    assert one_slot_server.process.wait(30) == 0
    assert "SIGTERM: finishing the requests in flight" in "".join(one_slot_server.lines)


def test_a_tensor_parallel_server_answers_like_a_one_rank_server(server, tiny_checkpoint):
    tp2 = ServerProcess(["--load", str(tiny_checkpoint), "--tensor-model-parallel-size", "2"], ranks=2)
    try:
        body = {"prompts": [PROMPT, "And God said"], "tokens_to_generate": 20, "top_k": 1, "logprobs": True}
        (status_1, one), (status_2, two) = server.api(body), tp2.api(body)
        assert status_1 == status_2 == 200
        for a, b, la, lb in zip(one["tokens"], two["tokens"], one["logprobs"], two["logprobs"]):
            parted = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            end = len(a) if parted is None else parted
            torch.testing.assert_close(torch.tensor(la[:end - 1]), torch.tensor(lb[:end - 1]), rtol=1e-4, atol=1e-4)
            if parted is not None:  # only at a near tie: both chose a top token of (nearly) equal log-probability
                assert abs(la[parted - 1] - lb[parted - 1]) < NEAR_TIE, (parted, la[parted - 1], lb[parted - 1])
    finally:
        tp2.stop()  # torchrun reports the SIGTERM it forwarded as its own failure: its status says nothing here


def test_the_kv_cache_is_sized_from_its_budget_and_said_at_start(server, tiny_checkpoint):
    """The default budget holds the tiny model's 32 slots; the cache is allocated at start, its
    size printed and reported by the health endpoint; --max-model-len shortens each slot."""
    health = server.health()
    started = "".join(server.lines)
    assert health["slots"] == 32 and health["kv_cache_bytes"] > 0
    assert f"KV cache: 32 slots x {health['max_model_len']} positions" in started
    short = ServerProcess(["--load", str(tiny_checkpoint), "--max-model-len", "64", "--kv-cache-memory", "200KiB"])
    try:
        info = short.health()
        assert info["max_model_len"] == 64 and info["kv_cache_bytes"] <= 200 * 1024
        per_slot = info["kv_cache_bytes"] // info["slots"]
        assert info["slots"] == min(32, 200 * 1024 // per_slot)
        status, body = short.api({"prompts": ["x" * 70], "tokens_to_generate": 1})
        assert status == 400 and "64" in body["message"]  # the prompt is longer than a slot
    finally:
        short.stop()


def test_serve_argument_errors_exit_2_before_loading(tiny_checkpoint, capsys):
    from dtmega.cli import main

    assert main(["serve", "--load", str(tiny_checkpoint), "--port", "70000"]) == 2
    assert "--port 70000 is not a TCP port" in capsys.readouterr().err
    assert main(["serve", "--load", str(tiny_checkpoint), "--kv-cache-memory", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "cannot hold one sequence" in err and "Fix: --kv-cache-memory" in err and "loading" not in err
    assert main(["serve", "--load", str(tiny_checkpoint), "--max-model-len", "100000"]) == 2
    assert "--max-model-len 100000 is longer than the model's context" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        try:
            assert main(["serve", "--load", str(tiny_checkpoint), "--port", str(port)]) == 2
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "loading" not in err  # before the checkpoint is read


def test_a_temperature_too_small_for_fp32_is_greedy_and_never_a_padding_id(server, model):
    """Matrix 3, H13: temperature 1e-300 overflowed logits / temperature, and the NaN softmax made
    the draw land on the vocabulary's padding rows (id 383 of 258 real ones), answered 200. Its
    limit is greedy: the same tokens as top_k 1, all real ids, finite log-probabilities."""
    _, tokenizer = model
    body = {"prompts": [PROMPT], "tokens_to_generate": 8, "stop_token": -1, "logprobs": True}
    status, tiny = server.api({**body, "temperature": 1e-300})
    assert status == 200, tiny
    status, greedy = server.api({**body, "top_k": 1})
    assert tiny["tokens"] == greedy["tokens"] and max(tiny["tokens"][0]) < tokenizer.vocab_size
    assert all(value == value and abs(value) != float("inf") for value in tiny["logprobs"][0])


def _unfinished_bodies(process: ServerProcess, count: int, timeout: float) -> list[socket.socket]:
    """`count` connections that announce a 100-byte body and send 6 bytes of it, then nothing."""
    host, port = process.url.removeprefix("http://").split(":")
    held = []
    for _ in range(count):
        connection = socket.create_connection((host, int(port)), timeout=timeout)
        connection.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100\r\n\r\n{\"pro")
        held.append(connection)
    return held


def _read_until_closed(connection: socket.socket) -> bytes:
    data = b""
    while chunk := connection.recv(4096):
        data += chunk
    return data


def test_a_body_that_never_finishes_is_answered_408_and_let_go(tiny_checkpoint):
    """Matrix 3, H20: a body announced longer than it is was held forever (no read deadline), and
    enough of them exhausted the server's descriptors. Now the body must arrive within
    --request-timeout (at most 30 s): 408, the connection closed, health answering meanwhile
    (bounds far apart: health within 5 s while the bodies are held for 8 s)."""
    import time

    process = ServerProcess(["--load", str(tiny_checkpoint), "--request-timeout", "8"])
    try:
        held = _unfinished_bodies(process, 20, timeout=10)
        started = time.monotonic()
        assert process.health()["status"] == "ok" and time.monotonic() - started < 5.0
        answers = [_read_until_closed(connection) for connection in held]  # the server closes each
        assert all(answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 8 s" in answer for answer in answers)
        assert time.monotonic() - started < 30
        for connection in held:
            connection.close()
    finally:
        assert process.stop() == 0, "".join(process.lines)[-3000:]


def test_h5_an_integer_of_thousands_of_digits_is_a_400(tiny_checkpoint):
    """Matrix 3, H5: a 5,000-digit integer (past Python's 4,300-digit conversion limit) was a
    plain-text 500."""
    process = ServerProcess(["--load", str(tiny_checkpoint)])
    try:
        status, body = process.api(b'{"prompts": ["x"], "tokens_to_generate": ' + b"9" * 5000 + b"}")
        assert status == 400 and "the request body is not JSON" in body["message"], body
        assert process.health()["status"] == "ok"
    finally:
        assert process.stop() == 0


def test_sigterm_does_not_wait_for_bodies_that_are_not_coming(tiny_checkpoint):
    """Matrix 3, H21: uvicorn's graceful shutdown waited --request-timeout for connections whose
    body never finished (5 minutes with the default). A stop now answers them 503 at once."""
    import time

    process = ServerProcess(["--load", str(tiny_checkpoint), "--request-timeout", "20"])
    held = _unfinished_bodies(process, 5, timeout=15)
    time.sleep(0.5)
    started = time.monotonic()
    assert process.stop(timeout=15) == 0, "".join(process.lines)[-3000:]
    assert time.monotonic() - started < 8
    answers = [_read_until_closed(connection) for connection in held]
    assert all(answer.startswith(b"HTTP/1.1 503") and b"shutting down" in answer for answer in answers), answers[0]


@pytest.mark.parametrize("prompt, message", [([], "prompt must be"), ([[]], "prompt 0 is empty"),
                                             ([True, False], "prompt must be"),
                                             ([2**70], "outside the vocabulary")])
def test_h8_token_id_prompts_that_mean_nothing_are_400s(server, prompt, message):
    """Matrix 3, H8 (GOOD, held): token-id prompts that are empty, booleans or past the vocabulary."""
    status, error = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 400 and error["error"]["param"] == "prompt" and message in error["error"]["message"], error


@pytest.mark.parametrize("body", [
    json.dumps({"prompt": "In", "max_tokens": 2, "temperature": 0}).encode("utf-16"),  # json.loads reads UTF-16
    b"\xef\xbb\xbf" + json.dumps({"prompt": "In", "max_tokens": 2}).encode(),  # a UTF-8 BOM
    b'{"prompt": "a", "prompt": "In", "max_tokens": 2}',  # duplicate keys: the last wins, as json does
    json.dumps({"prompt": "\x00\u202e\U0001f600e\u0301", "max_tokens": 2}).encode(),  # NUL, RTL, emoji, combining
])
def test_h7_unusual_but_valid_bodies_are_answered(server, body):
    """Matrix 3, H7 (GOOD, held)."""
    status, answer = server.request("POST", "/v1/completions", body)
    assert status == 200 and len(answer["choices"]) == 1, answer


def test_h10_h23_the_rest_of_the_context_and_many_logprobs(server):
    """Matrix 3, H10 (max_tokens null: up to the end of the context) and H23 (logprobs 20 for
    many choices), both held: 200, the sizes as asked, health ok after."""
    status, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": None, "temperature": 0})
    usage = body["usage"]
    assert status == 200 and usage["prompt_tokens"] + usage["completion_tokens"] <= 128
    if body["choices"][0]["finish_reason"] == "length":
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 128
    status, body = server.request("POST", "/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 20, "logprobs": 20,
                                                               "temperature": 1.0, "seed": 3})
    assert status == 200 and len(body["choices"]) == 16
    for choice in body["choices"]:  # keyed by text: ids that decode alike (bytes past UTF-8, specials) share a key
        tops = choice["logprobs"]["top_logprobs"]
        assert len(tops) == len(choice["logprobs"]["tokens"]) and all(0 < len(top) <= 20 for top in tops)
    assert server.health()["status"] == "ok"


def test_k5_an_infinite_request_timeout_serves(tiny_checkpoint):
    """Matrix 3, K5 (GOOD, held): --request-timeout inf means no deadline, and the server serves."""
    process = ServerProcess(["--load", str(tiny_checkpoint), "--request-timeout", "inf"])
    try:
        status, body = process.api({"prompts": ["In"], "tokens_to_generate": 2, "stop_token": -1})
        assert status == 200 and len(body["tokens"][0]) == 4
    finally:
        assert process.stop() == 0, "".join(process.lines)[-3000:]
