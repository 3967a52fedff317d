"""Megatron-LM's own launch lines through `dtmega train --dry-run`, with only the entry point and
the data, tokenizer and output paths changed: every flag is taken, except the features of the
docs' "Not built yet" table, each of which is refused alone with its row's reason.

The flag list is Megatron-LM's `examples/llama/train_llama3_8b_h100_fp8.sh` (the real-data
branch: MODEL_ARGS, TRAINING_ARGS with DDP_ARGS, DTYPE_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS_LIST,
EVAL_AND_LOGGING_ARGS; read at commit 157006d6d9bf of NVIDIA/Megatron-LM), expanded as bash
expands `${ARRAY[@]}` unquoted: `"--split '99,1,0'"` reaches the program as `--split` and
`'99,1,0'`, quotes included.
"""

from __future__ import annotations

import shlex

import pytest

from dtmega.cli import main
from dtmega.train.not_built import NOT_BUILT
from dtmega.train.trainer import train

LLAMA3_8B_H100_FP8 = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
--lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--data-path {data} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer} --data-cache-path {cache}
--split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --vocab-size 128256
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save {save} --load {save} --tensorboard-dir {tensorboard}
"""
GPUS = 8  # GPUS_PER_NODE x NUM_NODES of the script


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A small corpus tokenized with a BPE of our own (its tokenizer.json), and output paths."""
    from dtmega.data.preprocess import PreprocessConfig, preprocess
    from tests.corpus import make_texts, write_jsonl

    root = tmp_path_factory.mktemp("megatron_example")
    write_jsonl(root / "corpus.jsonl", make_texts(200, seed=5))
    result = preprocess(PreprocessConfig(input=root / "corpus.jsonl", output_prefix=str(root / "data" / "corpus"),
                                         train_tokenizer=512, append_eod=True, progress=False))
    return dict(data=str(root / "data" / "corpus_text_document"), tokenizer=str(result.tokenizer_path),
                cache=str(root / "cache"), save=str(root / "checkpoints"), tensorboard=str(root / "tb"))


def _argv(paths) -> list[str]:
    return shlex.split(LLAMA3_8B_H100_FP8.format(**paths), posix=True)


def _refused_rows(argv: list[str]) -> list:
    """The not-built rows this line asks for, and the line without their flags."""
    from dtmega.train.args import parse_train_args

    args = parse_train_args(argv)[0]
    return [item for item in NOT_BUILT if item.applies(args)]


def _without(argv: list[str], flags: set[str]) -> list[str]:
    kept, skip = [], False
    for token in argv:
        if skip and not token.startswith("--"):
            continue
        skip = token in flags
        if not skip:
            kept.append(token)
    return kept


def test_megatrons_llama3_8b_fp8_line_is_taken_but_for_the_not_built_features(paths, capsys):
    argv = _argv(paths)
    rows = _refused_rows(argv)
    flags = {flag for row in rows for flag in row.example if flag.startswith("--")}
    assert {row.flags for row in rows} == {"--attention-backend other than auto", "--apply-layernorm-1p",
                                           "--decoupled-lr/--decoupled-min-lr", "--no-mmap-bin-files", "--profile"}
    flags.add("--decoupled-min-lr")
    rest = _without(argv, flags)
    for row in rows:  # each alone on the rest of the line: refused with its reason, before any work
        assert main(["train", *rest, *row.example, "--dry-run", str(GPUS)]) == 2
        assert f"{row.flags}: {row.reason}" in capsys.readouterr().err
    capsys.readouterr()
    train([*rest, "--dry-run", str(GPUS)])  # every other flag of the line: checks out for 8 GPUs
    out = capsys.readouterr().out
    assert "--sequence-parallel with --tensor-model-parallel-size 1: sequence parallelism is off" in out
    assert "--vocab-size 128256 is NullTokenizer's" in out
