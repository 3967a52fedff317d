"""OpenAI's chat API in `dtmega serve`: the chat template rendered as transformers renders it,
/v1/chat/completions through the official `openai` client (whole and streamed), bad messages
refused with OpenAI's error shape while the server keeps serving, and a template that cannot be
used refused at start-up."""

from __future__ import annotations

import json

import pytest

from dtmega.data.chat_template import ChatTemplate, ChatTemplateError
from dtmega.serve.process import ServerProcess

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + "
          "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
STRICT = ("{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
          "{{ raise_exception('only user and assistant roles') }}{% endif %}{{ bos_token + message['content'] }}"
          "{% endfor %}")
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "In the beginning"},
            {"role": "assistant", "content": "God"}, {"role": "user", "content": "created"}]
SHORT = [{"role": "user", "content": "In the"}]  # the test server's context is 128 byte tokens


def tokenizer_dir(root, template: str | None, **tokens) -> str:
    root.mkdir(parents=True, exist_ok=True)
    config = {"eos_token": "<|im_end|>", "bos_token": {"content": "<s>", "lstrip": False}, **tokens}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return str(root)


@pytest.mark.parametrize("template", [CHATML, STRICT])
def test_the_template_renders_as_transformers_renders_it(template, tmp_path):
    from transformers.utils.chat_template_utils import render_jinja_template

    chat = ChatTemplate.load(tokenizer_dir(tmp_path / "tok", template))
    messages = MESSAGES[1:] if template is STRICT else MESSAGES
    ours = chat.render(messages)
    theirs = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                   eos_token="<|im_end|>", bos_token="<s>")
    theirs = theirs[0][0] if isinstance(theirs, tuple) else theirs
    theirs = theirs[0] if isinstance(theirs, list) else theirs
    assert ours == theirs and ours.endswith("<|im_start|>assistant\n" if template is CHATML else "created")
    if template is STRICT:
        with pytest.raises(ChatTemplateError, match="only user and assistant roles"):
            chat.render(MESSAGES)


def test_templates_from_a_jinja_file_and_named_lists_and_none(tmp_path):
    (tmp_path / "t.jinja").write_text(CHATML)
    tokenizer_dir(tmp_path, None)  # the special tokens beside the file
    assert ChatTemplate.load(tmp_path / "t.jinja").render(MESSAGES[1:2]).startswith("<|im_start|>user\nIn the")
    named = tokenizer_dir(tmp_path / "named", [{"name": "tool_use", "template": "x"}, {"name": "default",
                                                                                    "template": CHATML}])
    assert ChatTemplate.load(named).template == CHATML
    with pytest.raises(ChatTemplateError, match="holds no chat template"):
        ChatTemplate.load(tokenizer_dir(tmp_path / "base", None))
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate.load(tokenizer_dir(tmp_path / "broken", "{% for %}"))


@pytest.fixture(scope="module")
def chat_server(tiny_checkpoint, tmp_path_factory):
    template = tokenizer_dir(tmp_path_factory.mktemp("chat") / "tok", CHATML)
    process = ServerProcess(["--load", str(tiny_checkpoint), "--chat-template", template, "--model-name", "m", "tiny"])
    yield process, ChatTemplate.load(template)
    assert process.stop() == 0, "".join(process.lines)[-3000:]


def test_chat_completions_through_the_openai_client_whole_and_streamed(chat_server):
    """The assistant's turn of a greedy chat equals /v1/completions on the rendered conversation;
    streamed, every choice's chunks join to the non-streamed text for the same seed."""
    from openai import OpenAI

    server, chat = chat_server
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    greedy = client.chat.completions.create(model="m", messages=SHORT, max_tokens=10, temperature=0)
    prompt = chat.render(SHORT)
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0)
    answer = greedy.choices[0]
    assert answer.message.role == "assistant" and answer.message.content == plain.choices[0].text
    assert answer.finish_reason == plain.choices[0].finish_reason
    assert greedy.object == "chat.completion" and greedy.usage.completion_tokens == plain.usage.completion_tokens
    kwargs = dict(model="m", messages=SHORT, max_completion_tokens=12, temperature=0.9, top_p=0.95, seed=7, n=2)
    whole = client.chat.completions.create(**kwargs)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        usage = chunk.usage or usage
    assert texts == {c.index: c.message.content for c in whole.choices} and len(texts) == 2
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    scored = client.chat.completions.create(model="m", messages=SHORT, max_tokens=4, temperature=0, logprobs=True,
                                            top_logprobs=2)
    content = scored.choices[0].logprobs.content
    assert len(content) == scored.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


@pytest.mark.parametrize("messages, message", [
    ([{"content": "x"}], r"messages\[0\]\.role must be one of"),
    ([{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}], r"messages\[1\]\.role must be one of"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string or a list of text parts"),
    ([], "messages must be a non-empty list"),
    # matrix 3, H11 (an image part pointing at a file) and H12 (a conversation rendered past the context)
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
     r"messages\[0\]\.content must be a string or a list of text parts"),
    ([{"role": "user", "content": ""}] * 300, r"the rendered conversation has \d+ tokens, but the server's context"),
])
def test_bad_messages_get_400_in_openais_shape_and_the_server_keeps_serving(chat_server, messages, message):
    import re

    server, _ = chat_server
    status, error = server.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 400 and error["error"]["param"] == "messages" and re.search(message, error["error"]["message"])
    status, error = server.request("POST", "/v1/chat/completions", {"messages": SHORT, "tools": [{"x": 1}]})
    assert status == 400 and error["error"]["param"] == "tools"
    assert server.health()["status"] == "ok"


def test_a_model_the_server_does_not_serve_is_404_model_not_found(chat_server):
    """As OpenAI and vLLM answer: `gpt-4o` is not this server's model (it used to be answered by
    it); every name of --model-name is served, the first is the one /v1/models lists first."""
    from openai import NotFoundError, OpenAI

    server, _ = chat_server
    for path, body in (("/v1/chat/completions", {"messages": SHORT, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "In", "max_tokens": 2})):
        status, error = server.request("POST", path, {**body, "model": "gpt-4o"})
        assert status == 404 and error["error"]["code"] == "model_not_found" and error["error"]["param"] == "model"
        assert "'gpt-4o' does not exist" in error["error"]["message"] and "'m'" in error["error"]["message"]
        status, answer = server.request("POST", path, {**body, "model": "tiny"})
        assert status == 200 and answer["model"] == "tiny"
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=SHORT, max_tokens=2)
    assert [m.id for m in client.models.list().data] == ["m", "tiny"]


def test_a_server_without_a_template_says_how_to_give_one(tiny_checkpoint):
    server = ServerProcess(["--load", str(tiny_checkpoint)])
    try:
        status, error = server.request("POST", "/v1/chat/completions", {"messages": SHORT})
        assert status == 400 and "--chat-template" in error["error"]["message"]
    finally:
        assert server.stop() == 0


def test_a_template_that_cannot_be_used_is_refused_at_start_up(tiny_checkpoint, tmp_path, capsys):
    from dtmega.cli import main

    assert main(["serve", "--load", str(tiny_checkpoint), "--chat-template", tokenizer_dir(tmp_path / "t", None)]) == 2
    err = capsys.readouterr().err
    assert "holds no chat template" in err and "Fix:" in err


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("template, message", [
    (LOOP, r"did not finish rendering within 1 s"),
    ("{{ 10**(10**10) }}", r"computes 10\*\*10000000000, a number of more than 65536 bits"),
    ("{{ 'ab' * 10**9 }}", r"repeats a sequence to more than"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", r"did not finish rendering|rendered [\d,]+ characters"),
])
def test_a_render_is_bounded_in_time_arithmetic_and_size(monkeypatch, template, message):
    """Matrix 3, C1: `preprocess --chat` with nested loops (or `10**(10**10)`) hung until killed;
    Jinja's sandbox bounds one range, not nesting nor arithmetic. Every render is now bounded
    (10 s by default; 1 s here) and refused naming the template."""
    import time

    import dtmega.data.chat_template as module

    monkeypatch.setattr(module, "RENDER_SECONDS", 1.0)
    monkeypatch.setattr(module, "RENDER_CHARS", 1 << 20)
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=rf"the chat template of loop.jinja .*{message}|{message}"):
        ChatTemplate(template, "loop.jinja").render(SHORT)
    assert time.monotonic() - started < 5
    assert ChatTemplate(CHATML, "chatml", {"eos_token": "<e>"}).render(SHORT).endswith("assistant\n")  # untouched


def test_a_template_that_never_ends_does_not_stop_the_server(tiny_checkpoint, tmp_path):
    """Matrix 3, C2: the render ran on the event loop: health, every client, --request-timeout and
    SIGTERM stopped working (SIGKILL needed). Now it renders off the loop within its budget: 400
    naming the template, health answered in well under a second meanwhile, SIGTERM ends it."""
    import threading
    import time

    (tmp_path / "loop.jinja").write_text(LOOP)
    process = ServerProcess(["--load", str(tiny_checkpoint), "--chat-template", str(tmp_path / "loop.jinja")])
    try:
        answer: dict = {}
        client = threading.Thread(target=lambda: answer.update(reply=process.request(
            "POST", "/v1/chat/completions", {"messages": SHORT, "max_tokens": 2}, timeout=60)))
        started = time.monotonic()
        client.start()
        time.sleep(1.0)
        for _ in range(3):
            asked = time.monotonic()
            assert process.health()["status"] == "ok" and time.monotonic() - asked < 3.0  # the render takes 10 s
            status, body = process.request("POST", "/v1/completions", {"prompt": "In", "max_tokens": 1})
            assert status == 200, body
        client.join(60)
        status, body = answer["reply"]
        assert status == 400 and "did not finish rendering within 10 s" in body["error"]["message"], body
        assert time.monotonic() - started < 30
    finally:
        assert process.stop() == 0, "".join(process.lines)[-3000:]
