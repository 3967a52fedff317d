"""Megatron-LM's own launch lines through `dtmega train --dry-run`, with only the entry point and
the data, tokenizer and output paths changed: every flag is taken, except the features of the
docs' "Not built yet" table, each of which is refused alone with its row's reason.

The flag lists are Megatron-LM's examples, expanded as bash expands `${ARRAY[@]}` unquoted
(`"--split '99,1,0'"` reaches the program as `--split` and `'99,1,0'`, quotes included):
- `examples/llama/train_llama3_8b_h100_fp8.sh` (the real-data branch: MODEL_ARGS, TRAINING_ARGS
  with DDP_ARGS, DTYPE_ARGS, MODEL_PARALLEL_ARGS, DATA_ARGS_LIST, EVAL_AND_LOGGING_ARGS; read at
  commit 157006d6d9bf of NVIDIA/Megatron-LM);
- `examples/mixtral/train_mixtral_8x7b_distributed.sh`, `examples/gpt3/train_gpt3_175b_distributed.sh`
  and `examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh` (PRETRAIN_ARGS with the
  USE_MEGATRON_FSDP and WANDB branches) at commit d98e8a64ddf3. The Mixtral line includes its
  WANDB_API_KEY branch (W&B runs offline here).

World sizes are those the lines can run on in Megatron too: Mixtral's PP 4 x EP 8 needs 32 GPUs
(4 of the script's nodes), GPT-3's TP 8 x PP 16 128, DeepSeek's EP 8 with 2048 sequences of 4
64. The GPT-3 line names no --tokenizer-type, which Megatron itself refuses ("tokenizer_type None
is not supported"): `--tokenizer-type GPT2BPETokenizer` is added with its vocab and merges.

Then the Llama line's semantics run for real on 2 CPU ranks, scaled to a tiny model (the size
flags replaced, the not-built features left out, everything else as written).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

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
{data_args}
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save {save} --load {save} --tensorboard-dir {tensorboard}
"""
# DATA_ARGS_LIST's two branches: real data, and the script's default (TOKENIZER_ARG and DATA_ARG "MOCK")
LLAMA3_REAL_DATA = """--data-path {data} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer}
--data-cache-path {cache} --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--vocab-size 128256"""
LLAMA3_MOCK_DATA = """--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {cache}
--tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1"""
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
                cache=str(root / "cache"), save=str(root / "checkpoints"), tensorboard=str(root / "tb"),
                long=_long_corpus(root / "long" / "corpus_text_document"))


def _long_corpus(prefix: Path) -> str:
    """100 documents of 10,000 ids below 240 (in every tokenizer's vocabulary here): long enough for
    the examples' 2,048-8,192-token samples in the training and validation parts of their --split
    (the dry run checks the splits as the launch does); the text corpora stay for real training."""
    import numpy as np

    from dtmega.data.indexed import IndexedDatasetWriter

    writer = IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.RandomState(0)
    for _ in range(100):
        writer.add_document([rng.randint(0, 240, size=10_000)])
    writer.finalize()
    return str(prefix)


def _argv(paths, data_args: str = LLAMA3_REAL_DATA) -> list[str]:
    return shlex.split(LLAMA3_8B_H100_FP8.format(**paths, data_args=data_args.format(**paths)), posix=True)


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
    argv = _argv(dict(paths, data=paths["long"]))
    rows = _refused_rows(argv)
    flags = {flag for row in rows for flag in row.example if flag.startswith("--")}
    assert {row.flags for row in rows} == {"--decoupled-lr/--decoupled-min-lr", "--profile"}
    # no --normalization: Megatron's LayerNorm, zero-centred (--apply-layernorm-1p), with SwiGLU and RoPE
    from dtmega.train.args import parse_train_args
    from dtmega.train.prepare import model_of

    spec, config = model_of(parse_train_args(argv)[0], 128256)
    assert spec.family == "dtmega-gpt" and (config.normalization, config.layernorm_1p, config.activation,
                                            config.position_embedding, config.bias) == \
        ("LayerNorm", True, "swiglu", "rope", False)
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


def test_the_llama3_8b_fp8_script_as_shipped_lists_every_refusal_in_one_dry_run(paths, capsys):
    """The script's default branch (MOCK: NullTokenizer with --tiktoken-pattern v2, --no-mmap-bin-files
    with --mock-data) was refused on --tiktoken-pattern; one dry run now lists every not-built
    feature of the line, each with its reason, and without them the line checks out for 8 GPUs with
    notes for the flags that mean nothing there."""
    argv = _argv(paths, LLAMA3_MOCK_DATA)
    assert main(["train", *argv, "--dry-run", str(GPUS)]) == 2
    err = capsys.readouterr().err
    assert "2 features this line asks for are not built yet" in err
    for row in _refused_rows(argv):
        assert f"  - {row.flags}: {row.reason}" in err
    rest = _without(argv, {"--decoupled-lr", "--decoupled-min-lr", "--profile"})
    train([*rest, "--dry-run", str(GPUS)])
    out = capsys.readouterr().out
    assert "Arguments, files and plan check out" in out
    assert "--tiktoken-pattern configure(s) --tokenizer-type TikTokenizer" in out
    assert "--no-mmap-bin-files with --mock-data" in out


MIXTRAL_8X7B = """
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model {spm} --data-path {spm_data} --split 99990,8,2
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
--use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save {save} --load {save}
--tensorboard-dir {save}/tensorboard --no-load-optim --no-load-rng
--wandb-project Mixtral --wandb-exp-name Mixtral_8x7B
"""
GPT3_175B = """
--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
--attention-backend auto
--micro-batch-size 1 --global-batch-size 1536 --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0
--fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--data-path {gpt2_data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save {save} --load {save} --eval-iters 10
--tensorboard-dir {tensorboard} --tokenizer-type GPT2BPETokenizer
"""
DEEPSEEK_V3_MEGATRON_FSDP = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 8
--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear
--micro-batch-size 4 --global-batch-size 2048 --train-samples 585937500 --exit-duration-in-mins 220
--no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 --recompute-granularity selective
--recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine --seq-length 4096
--data-cache-path {cache} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer}
--data-path {data} --split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6
--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
--max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 3232
--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention
--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm
--lr-decay-samples 584765624 --lr-warmup-samples 1536000 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 256 --moe-layer-freq [0]*3+[1]*58
--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax
--moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4 --moe-router-num-groups 8
--moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion --moe-router-force-load-balancing
--q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
--eval-iters 32 --eval-interval 100 --auto-detect-ckpt-format --load {save} --save {save} --save-interval 100
--dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard
--log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1
--logging-level 40 --tensorboard-dir {tensorboard} --bf16 --enable-experimental
--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
--use-distributed-optimizer --calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor
--fsdp-double-buffer --use-nccl-ub --megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16
--wandb-project your_own_wandb_project --wandb-exp-name DeepSeek-V3-TP1EP8-MBS4GBS2048-
"""


@pytest.fixture(scope="module")
def more_paths(paths, tmp_path_factory):
    """A SentencePiece model and a GPT-2 style vocab.json/merges.txt of our own, each with the
    corpus tokenized by it."""
    import sentencepiece
    from tokenizers import ByteLevelBPETokenizer

    from dtmega.data.preprocess import PreprocessConfig, preprocess
    from dtmega.data.tokenizers import TokenizerSpec
    from tests.corpus import make_texts, write_jsonl

    root = tmp_path_factory.mktemp("megatron_examples_more")
    texts = make_texts(200, seed=6)
    write_jsonl(root / "corpus.jsonl", texts)
    (root / "text.txt").write_text("\n".join(texts))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "text.txt"), model_prefix=str(root / "spm"),
                                             vocab_size=250, model_type="bpe", minloglevel=2)
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(root / "text.txt")], vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(root))
    specs = {"spm_data": TokenizerSpec("Llama2Tokenizer", str(root / "spm.model")),
             "gpt2_data": TokenizerSpec("GPT2BPETokenizer", None, str(root / "vocab.json"), str(root / "merges.txt"))}
    found = dict(paths, spm=str(root / "spm.model"), vocab=str(root / "vocab.json"), merges=str(root / "merges.txt"))
    for key, spec in specs.items():
        preprocess(PreprocessConfig(input=root / "corpus.jsonl", output_prefix=str(root / key), tokenizer=spec,
                                    append_eod=True, progress=False))
        found[key] = str(root / f"{key}_text_document")
        found[key.replace("_data", "_long")] = _long_corpus(root / f"{key}_long_text_document")
    return found


def _segments(argv: list[str]) -> list[list[str]]:
    """The line as [flag, values...] groups."""
    groups: list[list[str]] = []
    for token in argv:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def _row_flags(row, groups: list[list[str]], args_of) -> set[str]:
    """The flags of the line that make `row` apply: the one named flag whose removal turns it off,
    else all the flags its name lists."""
    import re

    present = {g[0] for g in groups}
    named = [flag for flag in re.findall(r"--[a-z0-9][a-z0-9-]*", row.flags) if flag in present]  # the row's order
    for flag in named:
        if not row.applies(args_of([t for g in groups if g[0] != flag for t in g])):
            return {flag}
    return set(named)


@pytest.mark.parametrize("line, world, expected", [
    (MIXTRAL_8X7B, 32, set()),
    # Megatron's GPT blocks with the embedding tied across 16 pipeline stages: built (the GPT family);
    # only the batch-size ramp is not
    (GPT3_175B, 128, {"--rampup-batch-size --step-batch-size-schedule"}),
    (DEEPSEEK_V3_MEGATRON_FSDP, 64, {
        "--moe-flex-dispatcher-backend",
        "--moe-permute-fusion", "--moe-router-force-load-balancing", "--recompute-modules other than core_attn",
        "--fsdp-double-buffer --use-nccl-ub", "--megatron-fsdp-main-grads-dtype bf16"}),
], ids=["mixtral_8x7b", "gpt3_175b", "deepseek_v3_megatron_fsdp"])
def test_megatrons_example_lines_are_taken_but_for_the_not_built_features(line, world, expected, more_paths, capsys,
                                                                          monkeypatch):
    from dtmega.train.args import parse_train_args

    monkeypatch.setenv("WANDB_MODE", "offline")
    long = {"data": more_paths["long"], "spm_data": more_paths["spm_long"], "gpt2_data": more_paths["gpt2_long"]}
    argv = shlex.split(line.format(**{**more_paths, **long}), posix=True)
    groups = _segments(argv)
    args_of = lambda tokens: parse_train_args(tokens)[0]  # noqa: E731
    rows = [item for item in NOT_BUILT if item.applies(args_of(argv))]
    assert {row.flags for row in rows} == expected
    dropped = {row.flags: _row_flags(row, groups, args_of) for row in rows}
    fixes = [flag for row in rows for flag in row.without]  # a row met by a flag's absence: the fix adds it
    rest = [t for g in groups if not any(g[0] in flags for flags in dropped.values()) for t in g] + fixes
    for row in rows:  # each alone on the rest of the line: refused with its reason, before any work
        alone = [t for g in groups if g[0] in dropped[row.flags] for t in g]
        line_with_it = [t for t in rest if t not in row.without] + alone
        assert main(["train", *line_with_it, "--dry-run", str(world)]) == 2, row.flags
        assert f"{row.flags}: {row.reason}" in capsys.readouterr().err
    capsys.readouterr()
    train([*rest, "--dry-run", str(world)])  # every other flag of the line: checks out for that many GPUs
    out = capsys.readouterr().out
    assert "Arguments, files and plan check out" in out, out[-3000:]


TINY_SIZES = {"--num-layers": ["2"], "--hidden-size": ["64"], "--ffn-hidden-size": ["128"],
              "--num-attention-heads": ["4"], "--num-query-groups": ["2"], "--kv-channels": ["16"],
              "--seq-length": ["32"], "--max-position-embeddings": ["32"], "--global-batch-size": ["8"],
              "--micro-batch-size": ["2"], "--train-samples": ["48"], "--lr-decay-samples": ["40"],
              "--lr-warmup-samples": ["8"], "--eval-iters": ["1"], "--eval-interval": ["3"], "--save-interval": ["3"],
              "--vocab-size": ["512"]}


def test_the_llama_lines_semantics_train_for_real_on_two_cpu_ranks(paths, tmp_path):
    """The Llama line as a tiny model: every flag as written (bf16, FP8 hybrid with its amax
    history and parameter all-gather, the distributed optimizer, sample-based schedule, manual
    GC, the quoted split, ...) but the size and length flags, and the not-built features left
    out, and the CUDA-only attention kernel it asks for. Two ranks of torchrun train it (finite
    losses), validate at steps 3 and 6 and save."""
    from dtmega.train.args import parse_train_args

    argv = _argv(dict(paths, save=str(tmp_path / "checkpoints"), tensorboard=str(tmp_path / "tb")))
    groups = _segments(argv)
    args_of = lambda tokens: parse_train_args(tokens)[0]  # noqa: E731
    not_built = {flag for row in NOT_BUILT if row.applies(args_of(argv)) for flag in _row_flags(row, groups, args_of)}
    not_built.add("--decoupled-min-lr")  # the row names it beside --decoupled-lr
    # --attention-backend fused is cuDNN's attention, a CUDA kernel: refused on these CPU ranks
    # (the line's dry run for 8 GPUs above takes it)
    not_built.add("--attention-backend")
    line = [token for g in groups if g[0] not in not_built for token in ([g[0], *TINY_SIZES[g[0]]]
                                                                         if g[0] in TINY_SIZES else g)]
    line += ["--log-file", str(tmp_path / "metrics.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
               "--local-ranks-filter", "0", "-m", "dtmega", "train", *line]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(row) for row in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and all(loss == loss and loss < 20 for loss in losses)  # finite; ln(512) is 6.2
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000006"
    assert "--sequence-parallel with --tensor-model-parallel-size 1" in done.stdout
