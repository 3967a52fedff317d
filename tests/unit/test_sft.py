"""Chat data and SFT end to end (issue 34 item 4): `dtmega preprocess --chat` renders SmolLM2's
own chat template, puts the loss on the assistant's tokens only (checked by counting them
independently), packs conversations whole with their boundaries; bad chat files are one line
naming the line and the fix; `dtmega train --sft --load-hf` on 2 ranks trains on them (the loss
falls), and `dtmega serve` answers /v1/chat/completions for the saved checkpoint, with the chat
template it kept from SmolLM2 (no --chat-template), with the greedy text transformers' `generate`
gives for the same model and the same rendered prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dtmega.cli import main
from dtmega.data.chat_data import pack
from dtmega.data.chat_template import ChatTemplate
from dtmega.data.sft_dataset import SFTDataset
from dtmega.data.tokenizers import TokenizerSpec, build_tokenizer
from tests.smollm2 import smollm2_dir

SEQ = 96


def conversations(count: int = 24) -> list[dict]:
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"What is {i} plus {i}?"},
                    {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]
        if i % 3 == 0:
            messages = [{"role": "system", "content": "Answer in words."}, *messages,
                        {"role": "user", "content": "And twice that?"},
                        {"role": "assistant", "content": f"Twice that is {4 * i}."}]
        out.append({"messages": messages})
    return out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def preprocess(tmp_path, records, *extra) -> tuple[int, str]:
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    prefix = str(tmp_path / "data" / "chat")
    code = main(["preprocess", "--chat", "--input", source, "--output-prefix", prefix, "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", str(smollm2_dir()), "--seq-length", str(SEQ), *extra])
    return code, prefix


def test_the_loss_covers_exactly_the_assistants_tokens(tmp_path):
    records = conversations()
    code, prefix = preprocess(tmp_path, records)
    assert code == 0
    header = json.loads(open(f"{prefix}_sft.json").read())
    data = np.fromfile(f"{prefix}_sft.bin", dtype=np.int32).reshape(header["samples"], 3, SEQ + 1)
    tokenizer = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(smollm2_dir())))
    # counted independently: each answer's text and the template's end of turn ("<|im_end|>\n")
    expected = sum(len(tokenizer.encode(m["content"] + "<|im_end|>\n")) for r in records for m in r["messages"]
                   if m["role"] == "assistant")
    assert header["assistant_tokens"] == int(data[:, 1, 1:].sum()) == expected
    assert header["conversations"] == len(records) and header["samples"] < len(records)  # packed
    chat = ChatTemplate.load(smollm2_dir())
    flagged = [tokenizer.decode([int(t)]) for t, f in zip(data[:, 0].ravel(), data[:, 1].ravel()) if f]
    assert "".join(flagged).count("<|im_end|>") == sum(len(r["messages"]) // 2 for r in records)
    for sample in data:  # every conversation whole, in order, and the padding its own document
        documents = sample[2]
        assert (np.diff(documents) >= 0).all()
        for document in np.unique(documents)[:-1]:
            text = tokenizer.decode(sample[0][documents == document].tolist())
            assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n")
    # what training reads: the labels under the loss mask are exactly the answers and their end of turn
    fields = SFTDataset.to_fields(data.astype(np.int64))
    answers = "".join(tokenizer.decode([int(t)]) for t in fields["labels"][fields["loss_mask"].bool()])
    assert int(fields["loss_mask"].sum()) == expected
    assert sorted(answers.split("<|im_end|>\n"))[1:] == sorted(m["content"] for r in records for m in r["messages"]
                                                              if m["role"] == "assistant")
    assert fields["position_ids"][0, 0] == 0 and "document_ids" in fields.keys()
    first = chat.render(records[1]["messages"], add_generation_prompt=False)
    assert first.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_best_fit_packing_keeps_conversations_whole():
    bins = pack([60, 50, 40, 30, 20, 10], 97)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum([60, 50, 40, 30, 20, 10][i] for i in b) <= 97 for b in bins) and len(bins) == 3


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"content": "hi"}]}, r"chats.jsonl:2: message 0 has no role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, r"chats.jsonl:2: message 0 has the unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, r"chats.jsonl:2: message 0's content is list, not a string"),
    ({"text": "hi"}, r"chats.jsonl:2: no \"messages\" list"),
])
def test_a_bad_chat_file_is_one_line_naming_the_line_and_the_fix(tmp_path, capsys, record, message):
    import re

    code, prefix = preprocess(tmp_path, [conversations(1)[0], record])
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err) and "Fix:" in err, err
    assert not os.path.exists(f"{prefix}_sft.bin")  # nothing written


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((smollm2_dir() / "tokenizer.json").read_bytes())
    source = write_jsonl(tmp_path / "chats.jsonl", conversations(2))
    assert main(["preprocess", "--chat", "--input", source, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", str(bare), "--seq-length", "64"]) == 2
    assert "holds no chat template" in capsys.readouterr().err


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path):
    long = {"messages": [{"role": "user", "content": "tell me " * 80}, {"role": "assistant", "content": "no " * 80}]}
    records = [*conversations(4), long]
    code, prefix = preprocess(tmp_path, records, "--chat-overlong", "drop")
    header = json.loads(open(f"{prefix}_sft.json").read())
    assert code == 0 and header["dropped"] == 1 and header["truncated"] == 0
    code, prefix = preprocess(tmp_path, records)
    header = json.loads(open(f"{prefix}_sft.json").read())
    assert code == 0 and header["truncated"] == 1 and header["dropped"] == 0


def test_sft_end_to_end_train_on_two_ranks_then_chat_like_transformers(tmp_path):
    code, prefix = preprocess(tmp_path, conversations(16))
    assert code == 0
    save, hf = tmp_path / "ckpt", tmp_path / "hf"
    flags = ["train", "--sft", "--load-hf", str(smollm2_dir()), "--data-path", prefix, "--seq-length", str(SEQ),
             "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-5",
             "--min-lr", "3e-5", "--lr-warmup-iters", "0", "--split", "100,0,0", "--eval-iters", "0",
             "--log-interval", "1", "--save", str(save), "--save-interval", "3", "--save-hf", str(hf),
             "--log-file", str(tmp_path / "m.jsonl"),
             "--clip-grad", "1.0", "--seed", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--local-ranks-filter",
                           "0", "-m", "dtmega", *flags], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    # the served chat answer equals transformers' greedy generate on the same model (--save-hf's export)
    messages = [{"role": "user", "content": "What is 5 plus 5?"}]
    from dtmega.serve.process import ServerProcess

    server = ServerProcess(["--load", str(save)])  # no --chat-template: the checkpoint kept SmolLM2's (issue 47)
    try:
        status, body = server.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 12,
                                                                       "temperature": 0})
    finally:
        assert server.stop() == 0
    assert status == 200, body
    assert any(line.startswith("chat template: the checkpoint's own") for line in server.lines), server.lines
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False,
                             eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    expected = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=False).removesuffix("<|im_end|>")
    assert body["choices"][0]["message"]["content"] == expected
