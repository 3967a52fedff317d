"""A checkpoint saved by an SFT run chats with its own template (issue 47 item 2): `dtmega serve
--load` answers /v1/chat/completions with the template and special tokens the checkpoint kept
from its Hugging Face source (--chat-template overrides them), `dtmega generate --chat` renders
a conversation with the same code and stops at the template's end of turn, and `dtmega evaluate`
on the packed chat data reports the loss over the answers only: the run's own validation loss,
and the masked loss computed conversation by conversation with the model itself.

The SFT run is tiny: transformers' 2-block Llama (tests/hf_models.py) with a ChatML template,
12 conversations, 2 steps on one rank in this process."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from dtmega.cli import main as dtmega_main
from dtmega.data.chat_template import ChatTemplate
from dtmega.serve.chat_source import choose_chat_template
from dtmega.serve.process import ServerProcess
from dtmega.train.restore import read_head, read_hf_head

SEQ = 128  # two conversations a sample: attention within each is part of what evaluate must get right
OWN = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + eos_token + '\\n' }}"
       "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
OTHER = ("{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '### assistant: ' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 3?"}]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """(checkpoint, Hugging Face source, chat data prefix, the run's last validation loss)."""
    from dtmega.train.trainer import train
    from tests.hf_models import save_tiny_llama31

    root = tmp_path_factory.mktemp("sft_run")
    hf = save_tiny_llama31(root / "hf")
    (hf / "chat_template.jinja").write_text(OWN)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<s>"}))
    records = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                             {"role": "assistant", "content": f"{2 * i}."}]} for i in range(12)]
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prefix = str(root / "data" / "chat")
    assert dtmega_main(["preprocess", "--chat", "--input", str(root / "chats.jsonl"), "--output-prefix", prefix,
                        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf),
                        "--seq-length", str(SEQ)]) == 0
    header = json.loads(open(f"{prefix}_sft.json").read())
    assert header["samples"] < header["conversations"] == 12  # packed
    save = root / "ckpt"
    result = train(["--sft", "--load-hf", str(hf), "--data-path", prefix, "--seq-length", str(SEQ),
                    "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
                    "--split", "50,50,0", "--eval-iters", "2", "--eval-interval", "2", "--save", str(save),
                    "--save-interval", "2", "--seed", "5"])
    assert result.validation and result.validation[-1][0] == 2
    return save, hf, prefix, result.validation[-1][1]


def tokenizer_dir(root, template: str, **tokens) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": template,
                                                            **tokens}))
    return str(root)


# ---- which template: --chat-template > the checkpoint's own > (--load-hf) the directory's ------------

def test_the_checkpoint_keeps_its_template_and_special_tokens_and_an_override_wins(sft_run, tiny_checkpoint, tmp_path):
    save, hf, _, _ = sft_run
    own = choose_chat_template(None, read_head(save))
    assert own.template.template == OWN and own.template.special_tokens == {"bos_token": "<s>",
                                                                            "eos_token": "<|endoftext|>"}
    assert own.note.startswith("chat template: the checkpoint's own (chat_template.jinja kept in ")
    assert own.template.render(MESSAGES[1:]) == "<s><|im_start|>user\nWhat is 3 plus 3?<|endoftext|>\n<|im_start|>assistant\n"
    from_hf = choose_chat_template(None, read_hf_head(hf))
    assert from_hf.template.template == OWN and from_hf.note == f"chat template: {hf / 'chat_template.jinja'} " \
                                                                "(--chat-template overrides it)"
    other = choose_chat_template(tokenizer_dir(tmp_path / "other", OTHER), read_head(save))
    assert other.template.template == OTHER and "bos_token" not in other.template.special_tokens
    assert other.note == f"chat template: --chat-template {tmp_path / 'other'}"
    none = choose_chat_template(None, read_head(tiny_checkpoint))  # a byte-level pretraining run keeps none
    assert none.template is None and "keeps no chat template" in none.note and "--chat-template" in none.note


def test_special_tokens_the_config_lacks_come_from_special_tokens_map():
    chat = ChatTemplate.from_files({"tokenizer_config.json": json.dumps({"eos_token": "</s>", "chat_template": OWN}),
                                    "special_tokens_map.json": json.dumps({"eos_token": "<eos>", "bos_token": {
                                        "content": "<bos>", "lstrip": False}})}, "test")
    assert chat.special_tokens == {"eos_token": "</s>", "bos_token": "<bos>"}
    assert ChatTemplate.from_files({"tokenizer_config.json": "{}"}, "test") is None


# ---- dtmega serve --load <SFT checkpoint> ---------------------------------------------------------

def _chat_and_plain(server: ServerProcess, prompt: str) -> tuple[dict, dict]:
    status, chat = server.request("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8,
                                                                   "temperature": 0})
    assert status == 200, chat
    status, plain = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert status == 200, plain
    return chat, plain


def test_serve_answers_chat_with_the_checkpoints_own_template(sft_run):
    save, hf, _, _ = sft_run
    head = read_head(save)
    rendered = ChatTemplate.load(hf).render(MESSAGES)
    assert rendered.startswith("<s><|im_start|>system\nBe brief.<|endoftext|>\n")
    server = ServerProcess(["--load", str(save)])
    try:
        chat, plain = _chat_and_plain(server, rendered)
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
    # the prompt the server built is the template's rendering: its token count, and the greedy
    # answer equals the plain completion of that very text
    assert chat["usage"]["prompt_tokens"] == len(head.tokenizer.encode(rendered)) == plain["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert chat["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] > 0
    notes = [line for line in server.lines if line.startswith("chat template: ")]
    assert notes == [f"chat template: the checkpoint's own (chat_template.jinja kept in {head.checkpoint}/state.json) "
                     "(--chat-template overrides it)\n"], server.lines


def test_serve_chat_template_overrides_the_checkpoints_own(sft_run, tmp_path):
    save, _, _, _ = sft_run
    head = read_head(save)
    override = tokenizer_dir(tmp_path / "other", OTHER)
    rendered = ChatTemplate.load(override).render(MESSAGES)
    assert rendered == "### system: Be brief.\n### user: What is 3 plus 3?\n### assistant: "
    server = ServerProcess(["--load", str(save), "--chat-template", override])
    try:
        chat, plain = _chat_and_plain(server, rendered)
    finally:
        assert server.stop() == 0, "".join(server.lines)[-3000:]
    own = len(head.tokenizer.encode(ChatTemplate.load(str(sft_run[1])).render(MESSAGES)))
    assert chat["usage"]["prompt_tokens"] == len(head.tokenizer.encode(rendered)) != own
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert any(line == f"chat template: --chat-template {override}\n" for line in server.lines), server.lines


# ---- dtmega generate --chat -----------------------------------------------------------------------

def test_generate_chat_renders_like_the_server_and_prints_only_the_answer(sft_run, tmp_path, capsys):
    from dtmega.train.generate import main as generate

    save, hf, _, _ = sft_run
    rendered = ChatTemplate.load(hf).render(MESSAGES)
    flags = ["--load", str(save), "--greedy", "--max-new-tokens", "8"]
    plain = generate([*flags, "--prompt", rendered])
    capsys.readouterr()
    answer = generate([*flags, "--chat", "--message", "system:Be brief.", "--message", "user:What is 3 plus 3?"])
    printed = capsys.readouterr()
    assert answer == plain and printed.out == answer + "\n"  # stdout: the answer alone
    assert "chat template: the checkpoint's own (chat_template.jinja kept in" in printed.err
    (tmp_path / "m.json").write_text(json.dumps(MESSAGES))
    assert generate([*flags, "--chat", "--messages", str(tmp_path / "m.json")]) == answer
    (tmp_path / "body.json").write_text(json.dumps({"messages": MESSAGES[:1]}))  # an OpenAI body; then a flag
    assert generate([*flags, "--chat", "--messages", str(tmp_path / "body.json"), "--message",
                     "user:What is 3 plus 3?"]) == answer


def test_generate_chat_stops_at_the_templates_end_of_turn(sft_run, tmp_path):
    """A template whose eos_token is a token the model produces greedily: the answer ends just
    before it (the same answer without that stop continues past it)."""
    from dtmega.train.generate import generate_tokens
    from dtmega.train.generate import main as generate
    from dtmega.train.restore import restore

    save, _, _, _ = sft_run
    pm, tokenizer, _ = restore(save)
    plain_dir = tokenizer_dir(tmp_path / "plain", OTHER)
    prompt = tokenizer.encode(ChatTemplate.load(plain_dir).render(MESSAGES))
    ids = generate_tokens(pm.module.eval(), prompt, vocab_size=tokenizer.vocab_size, eod=tokenizer.eod,
                          max_new_tokens=8, temperature=0.0).ids
    candidates = [k for k, token in enumerate(ids) if token not in ids[:k] and token != tokenizer.eod
                  and tokenizer.encode(tokenizer.decode([token])) == [token]]
    assert candidates, ids
    k = candidates[-1]
    stop_dir = tokenizer_dir(tmp_path / "stop", OTHER, eos_token=tokenizer.decode([ids[k]]))
    flags = ["--load", str(save), "--greedy", "--max-new-tokens", "8", "--chat", "--message", "system:Be brief.",
             "--message", "user:What is 3 plus 3?"]
    assert generate([*flags, "--chat-template", plain_dir]) == tokenizer.decode(ids)
    assert generate([*flags, "--chat-template", stop_dir]) == tokenizer.decode(ids[:k])


@pytest.mark.parametrize("flags, message", [
    (["--chat", "--message", "What is 3 plus 3?"], r"--message 'What is 3 plus 3\?' does not start with a role\. "
                                                   r"Fix: --message ROLE:TEXT"),
    (["--chat", "--message", "wizard:hi"], r"does not start with a role"),
    (["--chat"], r"--chat needs a conversation\. Fix: --message user:TEXT"),
    (["--chat", "--prompt", "x", "--message", "user:x"], r"--prompt continues text; --chat answers a conversation"),
    (["--message", "user:x"], r"--message belong\(s\) to --chat\. Fix: add --chat"),
    ([], r"nothing to generate from\. Fix: --prompt TEXT, or --chat --message user:TEXT"),
])
def test_generate_chat_refuses_bad_flags_naming_the_fix(sft_run, capsys, flags, message):
    assert dtmega_main(["generate", "--load", str(sft_run[0]), *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_generate_chat_refuses_a_checkpoint_without_a_template_and_a_bad_messages_file(tiny_checkpoint, sft_run,
                                                                                       tmp_path, capsys):
    assert dtmega_main(["generate", "--load", str(tiny_checkpoint), "--chat", "--message", "user:hi"]) == 2
    err = capsys.readouterr().err
    assert "--chat needs a chat template" in err and "keeps none" in err and "Fix: --chat-template" in err
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "wizard", "content": "hi"}]))
    assert dtmega_main(["generate", "--load", str(sft_run[0]), "--chat", "--messages", str(tmp_path / "bad.json")]) == 2
    assert f"--messages {tmp_path / 'bad.json'}: messages[0].role must be one of" in capsys.readouterr().err


# ---- dtmega evaluate on the SFT data --------------------------------------------------------------

def test_evaluate_on_sft_data_reproduces_the_runs_validation_loss(sft_run, capsys):
    from dtmega.train.evaluate import main as evaluate

    save, _, prefix, validation = sft_run
    loss = evaluate(["--load", str(save), "--data-path", prefix])  # the run's own data: its validation settings
    assert loss == pytest.approx(validation, rel=1e-5)
    assert "packed chat samples" in capsys.readouterr().out  # detected from the files
    assert evaluate(["--load", str(save), "--data-path", prefix, "--sft"]) == pytest.approx(validation, rel=1e-5)


def test_evaluate_on_sft_data_is_the_loss_on_the_answers_only(sft_run):
    """Every sample of the file, each conversation run through the model alone, the loss summed
    over its flagged (answer) tokens only: the same mean evaluate prints."""
    from dtmega.train.evaluate import main as evaluate
    from dtmega.train.restore import restore

    save, _, prefix, _ = sft_run
    loss = evaluate(["--load", str(save), "--data-path", prefix, "--split", "0,1,0", "--micro-batch-size", "1"])
    pm, _, _ = restore(save)
    model = pm.module.eval()
    header = json.loads(open(f"{prefix}_sft.json").read())
    data = np.fromfile(f"{prefix}_sft.bin", dtype=np.int32).reshape(header["samples"], 3, SEQ + 1)
    total, count, unmasked, tokens_seen = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for tokens, flags, documents in data:
            for document in np.unique(documents):
                ids = torch.tensor(tokens[documents == document], dtype=torch.long)
                mask = torch.tensor(flags[documents == document][1:], dtype=torch.bool)
                if not mask.any():
                    continue  # the padding
                logits = model(ids[None, :-1])[0].float()
                losses = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
                total += float(losses[mask].sum())
                count += int(mask.sum())
                unmasked, tokens_seen = unmasked + float(losses.sum()), tokens_seen + len(losses)
    assert count == header["assistant_tokens"]
    assert loss == pytest.approx(total / count, rel=1e-5)
    assert abs(unmasked / tokens_seen - loss) > 1e-2  # the loss over every token is another number


def test_evaluate_sft_flags_are_checked_before_the_checkpoint(sft_run, tiny_checkpoint, capsys):
    save, _, prefix, _ = sft_run
    data = tiny_checkpoint.parent / "data" / "corpus_text_document"
    assert dtmega_main(["evaluate", "--load", str(save), "--data-path", str(data), "--sft"]) == 2
    err = capsys.readouterr().err
    assert "--sft reads" in err and "Fix: dtmega preprocess --chat" in err, err
    assert dtmega_main(["evaluate", "--load", str(save), "--data-path", prefix, "--seq-length", "32"]) == 2
    assert f"was packed for --seq-length {SEQ}, not 32. Fix: --seq-length {SEQ}" in capsys.readouterr().err
    assert dtmega_main(["evaluate", "--load", str(save), "--task", "lambada", "--valid-data", prefix, "--sft"]) == 2
    assert "--sft evaluates packed chat samples" in capsys.readouterr().err
