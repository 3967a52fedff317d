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
                                             "SentencePiece tokenizer.model (Llama2Tokenizer, GPTSentencePieceTokenizer)")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: the token ids are 0..N-1, N is end-of-document")
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
    return p


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.split_sentences:
        raise DtmegaError("--split-sentences is not supported yet: documents are tokenized whole")
    if args.train_tokenizer and args.tokenizer_type not in (None, "HuggingFaceTokenizer"):
        raise DtmegaError("--train-tokenizer makes a HuggingFaceTokenizer; drop --tokenizer-type or set it to that")
    if not args.train_tokenizer and args.tokenizer_type is None:
        raise DtmegaError("--tokenizer-type is required (or --train-tokenizer VOCAB_SIZE)")
    spec = TokenizerSpec(args.tokenizer_type or "byte", args.tokenizer_model, args.vocab_file, args.merge_file,
                         args.eod_token, args.vocab_size)
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
