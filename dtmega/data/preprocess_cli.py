"""`dtmega preprocess` flags (Megatron's tools/preprocess_data.py names)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from dtmega.data.preprocess import PreprocessConfig, preprocess
from dtmega.data.tokenizers import TOKENIZER_TYPES, TokenizerSpec
from dtmega.kernels.errors import DtmegaError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmega preprocess", description="Tokenize JSONL into Megatron .bin/.idx files.")
    p.add_argument("--input", type=Path, required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (one dataset each)")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    p.add_argument("--tokenizer-model", help="tokenizer.json or a Hugging Face directory (HuggingFaceTokenizer), a "
                                             "SentencePiece tokenizer.model (Llama2Tokenizer, GPTSentencePieceTokenizer), "
                                             "a tiktoken vocabulary .json (TikTokenizer)")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: the token ids are 0..N-1, N is end-of-document; "
                                                  "TikTokenizer: its vocabulary size (default 131072)")
    p.add_argument("--tiktoken-pattern", choices=("v1", "v2"), help="TikTokenizer: the split regex (default v2)")
    p.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: special-token ids before the vocabulary's ranks (default 1000)")
    p.add_argument("--tiktoken-special-tokens", nargs="+", help="TikTokenizer: the special tokens (default <unk> <s> "
                                                                "</s> <mask> <pad> <cls> <sep>)")
    p.add_argument("--vocab-file", help="vocab.json (GPT2BPETokenizer)")
    p.add_argument("--merge-file", help="merges.txt (GPT2BPETokenizer)")
    p.add_argument("--eod-token", help="end-of-document token (default: found in the vocabulary)")
    p.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                   help="train a byte-level BPE of this size on the input; saves tokenizer.json beside the output")
    p.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) malformed lines instead of failing")
    p.add_argument("--split-sentences", action="store_true", help="not supported yet")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    chat = p.add_argument_group("chat (SFT) data", "--chat: JSONL conversations rendered with the tokenizer's chat "
                                "template, loss on the assistant's tokens, packed into --seq-length samples "
                                "(dtmega train --sft reads them)")
    chat.add_argument("--chat", action="store_true", help="the input holds {\"messages\": [...]} conversations")
    chat.add_argument("--seq-length", type=int, help="--chat: tokens per training sample (the run's --seq-length)")
    chat.add_argument("--chat-template", help="--chat: a .jinja file or tokenizer directory (default: "
                                              "--tokenizer-model's directory's template)")
    chat.add_argument("--chat-overlong", choices=("truncate", "drop"), default="truncate",
                      help="--chat: a conversation longer than a sample is cut there or left out (counted either way)")
    return p


def preprocess_chat_main(args: argparse.Namespace, console: Console) -> None:
    """`dtmega preprocess --chat`: everything checked before a line is read."""
    from dtmega.data.chat_data import preprocess_chat
    from dtmega.data.chat_template import ChatTemplate
    from dtmega.data.tokenizers import build_tokenizer

    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.tokenizer_model:
        raise DtmegaError("--chat renders conversations with a Hugging Face tokenizer's chat template. Fix: "
                          "--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (its tokenizer_config.json "
                          "holds the template)")
    if args.seq_length is None or args.seq_length < 2:
        raise DtmegaError("--chat packs conversations into training samples: give --seq-length (the training run's)")
    model_dir = Path(args.tokenizer_model)
    chat = ChatTemplate.load(args.chat_template or (model_dir if model_dir.is_dir() else model_dir.parent))
    tokenizer = build_tokenizer(TokenizerSpec(args.tokenizer_type, args.tokenizer_model, eod_token=args.eod_token))
    counts = preprocess_chat(args.input, args.output_prefix, tokenizer, chat, args.seq_length, args.chat_overlong,
                             args.tokenizer_model)
    console.print(f"{counts.conversations} conversations -> {counts.samples} samples of {args.seq_length + 1} tokens "
                  f"({counts.assistant_tokens} assistant tokens in the loss); {counts.truncated} truncated, "
                  f"{counts.dropped} dropped, {counts.without_answer} without an answer: "
                  f"{args.output_prefix}_sft.bin / .json", highlight=False)


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.chat:
        preprocess_chat_main(args, Console(stderr=True))
        return
    if args.split_sentences:
        raise DtmegaError("--split-sentences is not supported yet: documents are tokenized whole")
    if args.train_tokenizer and args.tokenizer_type not in (None, "HuggingFaceTokenizer"):
        raise DtmegaError("--train-tokenizer makes a HuggingFaceTokenizer; drop --tokenizer-type or set it to that")
    if not args.train_tokenizer and args.tokenizer_type is None:
        raise DtmegaError("--tokenizer-type is required (or --train-tokenizer VOCAB_SIZE)")
    tiktoken = args.tokenizer_type == "TikTokenizer"
    spec = TokenizerSpec(args.tokenizer_type or "byte", args.tokenizer_model, args.vocab_file, args.merge_file,
                         args.eod_token, args.vocab_size,
                         tiktoken_pattern=args.tiktoken_pattern if tiktoken else None,
                         tiktoken_num_special_tokens=args.tiktoken_num_special_tokens if tiktoken else None,
                         tiktoken_special_tokens=tuple(args.tiktoken_special_tokens or ()) or None if tiktoken else None)
    console = Console(stderr=True)
    result = preprocess(
        PreprocessConfig(
            input=args.input, output_prefix=args.output_prefix, json_keys=args.json_keys, tokenizer=spec,
            append_eod=args.append_eod, workers=args.workers, train_tokenizer=args.train_tokenizer,
            skip_bad_lines=args.skip_bad_lines, progress=not args.no_progress,
        ),
        console,
    )
    for key, prefix in result.outputs.items():
        console.print(f"{key}: {prefix}.bin / .idx")
    if result.tokenizer_path:
        console.print(f"tokenizer: {result.tokenizer_path} (train with --tokenizer-type HuggingFaceTokenizer "
                      f"--tokenizer-model {result.tokenizer_path})")
    console.print(f"{result.documents:,} documents, {result.tokens:,} tokens, {result.skipped_lines} lines skipped, "
                  f"{result.input_bytes / 1e6:.1f} MB in {result.seconds:.1f} s ({result.mb_per_second:.1f} MB/s)")
