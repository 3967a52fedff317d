"""`dtmega convert`: checkpoints in and out of dtmega.

    dtmega convert hf-to-dtmega --hf-dir SmolLM2-135M --save ckpt
    dtmega convert dtmega-to-hf --load ckpt --hf-dir out [--dtype bfloat16] [--max-shard-size 5GB]
    dtmega convert megatron-to-dtmega --load mcore_ckpt --save ckpt --num-attention-heads 32 ...

hf-to-dtmega may run under torchrun (the ranks shard the model and each writes its part);
the other two run in one process and stream tensor by tensor (or shard by shard).
"""

from __future__ import annotations

import argparse
import re

from dtmega.kernels.errors import DtmegaError
from dtmega.printing import console
from dtmega.progress import progress_bar

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)i?B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of a size written as 5GB, 500MB, 2GiB or a plain number of bytes."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise DtmegaError(f"--max-shard-size {text!r}: write it as 5GB, 500MB or a number of bytes")
    number, unit = match.groups()
    return int(float(number) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit.upper()])


def build_parser() -> argparse.ArgumentParser:
    """The three conversions and their options."""
    parser = argparse.ArgumentParser(prog="dtmega convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = parser.add_subparsers(dest="kind", required=True)
    hf_in = kinds.add_parser("hf-to-dtmega", help="a Hugging Face model directory -> a dtmega checkpoint")
    hf_in.add_argument("--hf-dir", required=True, help="config.json, *.safetensors (+ index), tokenizer files (without "
                                                       "them the weights convert, and generate/serve/evaluate take "
                                                       "--tokenizer-model)")
    hf_in.add_argument("--save", required=True, help="dtmega checkpoint directory to write (iter_0000000)")
    hf_in.add_argument("--tokenizer-model", help="another tokenizer (tokenizer.json, tokenizer.model or a directory)")
    add_overwrite_argument(hf_in)
    hf_out = kinds.add_parser("dtmega-to-hf", help="a dtmega checkpoint -> a Hugging Face model directory")
    hf_out.add_argument("--load", required=True, help="checkpoint (a --save directory or an iter_* directory)")
    hf_out.add_argument("--hf-dir", required=True, help="new directory to write (refused if it holds files)")
    hf_out.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="weights' dtype (default: the source model's, else float32)")
    hf_out.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    mcore = kinds.add_parser("megatron-to-dtmega", help="a Megatron-Core torch_dist GPT checkpoint -> dtmega")
    from dtmega.interop.megatron_cli import add_megatron_arguments

    add_megatron_arguments(mcore)
    add_overwrite_argument(mcore)
    return parser


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    """--overwrite-checkpoints, as `dtmega train` has it (save_ownership.py)."""
    parser.add_argument("--overwrite-checkpoints", action="store_true",
                        help="write into a --save that already holds checkpoints (its latest then names the "
                             "converted iter_0000000); without it such a --save is refused")


def main(argv: list[str]) -> str:
    """Runs one conversion; prints and returns where it wrote."""
    a = build_parser().parse_args(argv)
    if a.kind in ("hf-to-dtmega", "megatron-to-dtmega"):  # before reading anything: whose --save is it?
        from dtmega.train.save_ownership import check_save_ownership

        for note in check_save_ownership(a.save, None, None, a.overwrite_checkpoints, f"dtmega convert {a.kind}"):
            console().print(f"[dim]note: {note}[/dim]")
    if a.kind == "hf-to-dtmega":
        from dtmega.interop.hf_import import import_hf

        with progress_bar(f"convert {a.hf_dir}", total=4, unit="phases", phased=True) as bar:
            written = import_hf(a.hf_dir, a.save, tokenizer_model=a.tokenizer_model, on_phase=bar.phase,
                                allow_older=a.overwrite_checkpoints)
    elif a.kind == "dtmega-to-hf":
        from dtmega.interop.hf_export import export_hf

        limit = parse_size(a.max_shard_size)
        with progress_bar(f"convert {a.load}", total=None, unit="shards") as bar:
            def on_shard(done: int, total: int) -> None:
                bar.set_total(total)
                bar.advance()

            written = export_hf(a.load, a.hf_dir, dtype=a.dtype, max_shard_bytes=limit, on_shard=on_shard)
    else:
        from dtmega.interop.megatron_cli import convert_megatron

        written = convert_megatron(a)
    console().print(f"wrote {written}", highlight=False)
    return str(written)
