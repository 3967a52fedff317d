"""`dtmega train` arguments: Megatron flags, TOML, presets, notes and refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dtmega.models import LlamaConfig
from dtmega.passes import DataParallel, FuseKernels, Recompute, SequenceParallel, TensorParallel
from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.setup import build_plan, model_config, padded_vocab, plan_notes, reject_unsupported, run_shape

MEGATRON_LLAMA = (
    "--tensor-model-parallel-size 2 --sequence-parallel --num-layers 4 --hidden-size 256 --ffn-hidden-size 768 "
    "--num-attention-heads 8 --group-query-attention --num-query-groups 4 --seq-length 128 "
    "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 16 --lr 3e-4 --min-lr 3e-5 "
    "--train-iters 100 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --bf16 --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
    "--recompute-granularity selective --use-distributed-optimizer --data-path 0.5 a 0.5 b --split 969,30,1 "
    "--tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt --save out --save-interval 50 "
    "--eval-interval 50 --eval-iters 5 --log-interval 10 --seed 7 --tensorboard-dir tb "
    "--use-mcore-models --transformer-impl transformer_engine --use-flash-attn"
).split()


def test_a_megatron_launch_line_parses_with_notes():
    args, notes = parse_train_args(MEGATRON_LLAMA)
    assert args.tensor_model_parallel_size == 2 and args.sequence_parallel and args.num_query_groups == 4
    assert args.data_path == ["0.5", "a", "0.5", "b"] and args.split_weights == (969.0, 30.0, 1.0)
    assert len(notes) == 3 and any("--use-flash-attn accepted" in n for n in notes)
    shape = run_shape(args, world=8)
    assert (shape.dp, shape.accumulation) == (4, 2)
    config = model_config(args, tokenizer_vocab=50257)
    assert config.vocab_size == 50432 and config.n_kv_heads == 4 and not config.tie_embeddings
    plan = build_plan(args, shape, config.n_layers)
    kinds = [type(p) for p in plan]
    assert kinds == [TensorParallel, SequenceParallel, Recompute, FuseKernels, DataParallel]
    fuse = plan.passes[3]  # Megatron's defaults: RoPE, SwiGLU and norm fusion on, the fused loss opt-in
    assert (fuse.rope, fuse.swiglu, fuse.rms_norm, fuse.cross_entropy) == (None, None, None, False)
    args, _ = parse_train_args([*MEGATRON_LLAMA, "--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-rms-norm-fusion"])
    assert FuseKernels not in [type(p) for p in build_plan(args, shape, config.n_layers)]
    args, _ = parse_train_args([*MEGATRON_LLAMA, "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"])
    with pytest.raises(ArgumentError, match="Transformer Engine's fused cross entropy"):
        build_plan(args, shape, config.n_layers)
    assert plan.passes[-1].mode == "fsdp" and plan.passes[-1].param_dtype == "bfloat16"


def test_toml_then_flags_override(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "debug"\nlr = 1e-3\ntrain_iters = 5\nseq-length = 64\n')
    args, _ = parse_train_args(["--config", str(config), "--lr", "2e-3"])
    assert args.lr == 2e-3 and args.train_iters == 5 and args.seq_length == 64
    assert args.num_layers == 4 and args.hidden_size == 64  # from the preset
    config.write_text("learning_rate = 1\n")
    with pytest.raises(ArgumentError, match=r"unknown option\(s\) \['learning_rate'\]"):
        parse_train_args(["--config", str(config)])


def test_planned_and_unsupported_features_are_refused():
    for flags, message in [
        (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--multi-latent-attention",
          "--qk-layernorm", "--normalization", "LayerNorm"], "GPT-block features with --multi-latent-attention"),
        (["--bf16", "--fp16"], "exclusive"),
    ]:
        with pytest.raises(ArgumentError, match=message):
            reject_unsupported(parse_train_args(flags)[0])


def test_global_batch_must_divide():
    args, _ = parse_train_args(["--micro-batch-size", "3", "--global-batch-size", "16"])
    with pytest.raises(ArgumentError, match=r"--global-batch-size 16 is not divisible by --micro-batch-size 3 x "
                                            r"data-parallel size 2 \(= 6\)"):
        run_shape(args, world=2)


def test_plan_mapping_errors_and_recompute_methods():
    args, _ = parse_train_args(["--sequence-parallel"])  # at TP 1: off, with Megatron's warning
    assert SequenceParallel not in [type(p) for p in build_plan(args, run_shape(args, 2), 4)]
    assert "sequence parallelism is off" in plan_notes(args, run_shape(args, 2))[0]
    args, _ = parse_train_args(["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"])
    recompute = build_plan(args, run_shape(args, 1), 4).passes[0]
    assert recompute.policy == "full" and recompute.first == 2
    args, _ = parse_train_args(["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "2"])
    with pytest.raises(ArgumentError, match="not supported yet"):
        build_plan(args, run_shape(args, 1), 4)


def test_vocab_padding_and_missing_model_shape():
    args, _ = parse_train_args(["--tensor-model-parallel-size", "4"])
    assert padded_vocab(8192, args) == 8192 and padded_vocab(8193, args) == 8704
    with pytest.raises(ArgumentError, match="needs --num-layers, --hidden-size, --num-attention-heads"):
        model_config(args, 100)


def test_pipeline_flags_build_the_pipeline_pass():
    from dtmega.passes import PipelineSplit

    args, _ = parse_train_args([
        "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
        "2", "--global-batch-size", "16", "--micro-batch-size", "2", "--decoder-first-pipeline-num-layers", "1",
        "--decoder-last-pipeline-num-layers", "3",
    ])
    shape = run_shape(args, world=8)
    assert (shape.pp, shape.tp, shape.dp, shape.accumulation) == (2, 2, 2, 4)
    split = [p for p in build_plan(args, shape, n_layers=8) if isinstance(p, PipelineSplit)][0]
    assert (split.schedule, split.virtual_stages, split.microbatches) == ("interleaved_1f1b", 2, 4)
    assert (split.first_stage_layers, split.last_stage_layers) == (1, 3)


def test_context_parallel_flags():
    from dtmega.passes import ContextParallel

    # GPT blocks (Megatron's defaults) drop attention probabilities, which CP's kernels do not: off here
    args, _ = parse_train_args(["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--tensor-model-parallel-size", "2",
                                "--attention-dropout", "0"])
    shape = run_shape(args, world=8)
    assert (shape.cp, shape.dp) == (2, 2)
    cp = [p for p in build_plan(args, shape, 4) if isinstance(p, ContextParallel)][0]
    assert cp.method == "a2a" and cp.load_balance == "zigzag"
    with pytest.raises(ArgumentError, match="does not divide the world size 6"):
        run_shape(parse_train_args(["--context-parallel-size", "4"])[0], world=6)


def test_microbatches_flag_sets_or_checks_the_micro_batch():
    args, _ = parse_train_args(["--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--microbatches", "4"])
    shape = run_shape(args, world=4)
    assert (shape.micro_batch, shape.accumulation) == (2, 4)
    args, _ = parse_train_args(["--global-batch-size", "16", "--micro-batch-size", "2", "--microbatches", "4"])
    with pytest.raises(ArgumentError, match=r"--microbatches 4 disagrees .* = 2"):
        run_shape(args, world=4)
    args, _ = parse_train_args(["--pipeline-schedule", "zbv"])
    with pytest.raises(ArgumentError, match="need --pipeline-model-parallel-size > 1"):
        build_plan(args, run_shape(args, 1), 4)


def test_moe_flags_build_the_model_and_the_expert_parallel_pass():
    from dtmega.passes import ExpertParallel, TensorParallel

    args, _ = parse_train_args([
        "--swiglu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--num-experts", "8",
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "([0]*1+[1]*3)",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-4",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-expert-capacity-factor",
        "1.5", "--moe-token-drop-policy", "position", "--moe-token-dispatcher-type", "alltoall",
        "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
        "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "48",
    ])
    config = model_config(args, 256)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.ffn_dim, moe.first_dense_layers, moe.layer_freq) == (8, 2, 32, 1, 1)
    assert (moe.load_balancing, moe.aux_loss_coeff, moe.z_loss_coeff, moe.score_func) == ("seq_aux_loss", 1e-3, 1e-4, "sigmoid")
    assert moe.expert_bias and moe.capacity_factor == 1.5 and moe.token_drop_policy == "position"
    assert moe.grouped_gemm and moe.shared_expert_ffn_dim == 48
    shape = run_shape(args, world=8)
    assert (shape.dp, shape.ep, shape.dp_shard, shape.tp) == (4, 2, 2, 2)
    plan = list(build_plan(args, shape, 4))
    assert [type(p).__name__ for p in plan] == ["TensorParallel", "ExpertParallel", "FuseKernels", "DataParallel"]
    assert isinstance(plan[1], ExpertParallel) and plan[1].dispatcher == "alltoall" and isinstance(plan[0], TensorParallel)


def test_moe_presets_and_errors():
    args, _ = parse_train_args(["--model", "mixtral-8x7b"])
    assert model_config(args, 32000).moe == LlamaConfig.from_name("mixtral-8x7b").moe
    args, _ = parse_train_args(["--model", "deepseek-v3-small"])
    assert model_config(args, 32768).moe == LlamaConfig.from_name("deepseek-v3-small").moe
    with pytest.raises(ArgumentError, match="expert parallelism borrows data-parallel ranks, and the data-parallel size is 2"):
        run_shape(parse_train_args(["--num-experts", "8", "--expert-model-parallel-size", "4",
                                    "--tensor-model-parallel-size", "2"])[0], world=4)
    with pytest.raises(ArgumentError, match="--moe-expert-capacity-factor need.* --num-experts"):
        model_config(parse_train_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
                                       "--moe-expert-capacity-factor", "1.0"])[0], 256)
    listed = model_config(parse_train_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
                                            "--num-experts", "4", "--moe-layer-freq", "[1,0]"])[0], 256).moe
    assert (listed.first_dense_layers, listed.layer_freq) == (0, 2)  # Megatron's list: MoE every 2nd block
    with pytest.raises(ArgumentError, match="--moe-layer-freq '\\[1,0,1\\]': a list of 3 flags for --num-layers 2"):
        model_config(parse_train_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
                                       "--num-experts", "4", "--moe-layer-freq", "[1,0,1]"])[0], 256)
    with pytest.raises(ArgumentError, match="top_k=5 must be between 1 and num_experts=4"):
        model_config(parse_train_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
                                       "--num-experts", "4", "--moe-router-topk", "5"])[0], 256)
    args, _ = parse_train_args(["--num-experts", "8", "--tensor-model-parallel-size", "4",
                                "--expert-tensor-parallel-size", "2"])
    with pytest.raises(ArgumentError, match="other expert tensor-parallel sizes are not supported yet"):
        build_plan(args, run_shape(args, world=4), 4)


def test_expert_tensor_parallel_size_1_folds_the_experts_over_tp_as_megatron():
    """ETP 1 (Megatron's MoE parallel folding): EP's ranks take in the TP ranks, so the mesh's ep
    axis is EP / TP carved from data parallelism and ExpertParallel folds tp in; the expert data
    parallelism is world / (EP x PP) as Megatron's. EP below TP keeps the experts whole on every
    TP rank; EP neither below TP nor a multiple of it is refused by name."""
    from dtmega.passes import ExpertParallel, TensorParallel

    args, _ = parse_train_args(["--num-experts", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"])
    shape = run_shape(args, world=8)
    assert (shape.tp, shape.dp, shape.ep, shape.expert_fold, shape.expert_parallel) == (2, 4, 2, 2, 4)
    passes = {type(item): item for item in build_plan(args, shape, 4).passes}
    assert passes[TensorParallel].expert_hidden is False and passes[ExpertParallel].fold == ("tp",)
    args, _ = parse_train_args(["--num-experts", "8", "--tensor-model-parallel-size", "2",
                                "--expert-tensor-parallel-size", "1"])
    shape = run_shape(args, world=4)
    passes = {type(item): item for item in build_plan(args, shape, 4).passes}
    assert shape.expert_fold == 1 and ExpertParallel not in passes and passes[TensorParallel].expert_hidden is False
    args, _ = parse_train_args(["--num-experts", "8", "--tensor-model-parallel-size", "4",
                                "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"])
    with pytest.raises(ArgumentError, match="2 is not a multiple of 4"):
        run_shape(args, world=8)


def test_expert_tensor_parallel_size_without_experts_splits_nothing_but_needs_megatrons_world():
    """Megatron builds its expert groups (ETP x EP x PP ranks) even for a dense model, and refuses a
    world they do not tile; a dense model's ETP other than TP is accepted here with a note."""
    from dtmega.train.setup import plan_notes

    args, _ = parse_train_args(["--num-layers", "2", "--tensor-model-parallel-size", "2",
                                "--expert-tensor-parallel-size", "4"])
    shape = run_shape(args, world=4)
    assert [type(item).__name__ for item in build_plan(args, shape, 2).passes][0] == "TensorParallel"
    assert any("without --num-experts" in note for note in plan_notes(args, shape))
    with pytest.raises(ArgumentError, match="not a multiple of ETP x EP x PP = 4"):
        build_plan(args, run_shape(args, world=2), 2)


@pytest.mark.parametrize("name", ["demo", "moe"])
def test_shipped_configs_build_a_plan_for_four_ranks(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.toml"
    args, _ = parse_train_args(["--config", str(path)])
    shape = run_shape(args, world=4)
    config = model_config(args, 8192)
    plan = build_plan(args, shape, config.n_layers)
    assert (shape.tp, shape.dp) == (2, 2)
    if name == "moe":
        assert config.moe.num_experts == 8 and shape.ep == 2
        assert "ExpertParallel" in [type(p).__name__ for p in plan]


def test_model_on_the_command_line_replaces_the_tomls_sizes(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('num_layers = 4\nhidden_size = 256\nnum_attention_heads = 8\nlr = 1e-3\n')
    args, notes = parse_train_args(["--config", str(config), "--model", "llama3-70b", "--num-layers", "2"])
    assert (args.hidden_size, args.num_attention_heads, args.num_layers, args.lr) == (8192, 64, 2, 1e-3)
    assert any("--model llama3-70b replaces" in note and "hidden_size" in note for note in notes)
    shipped = Path(__file__).resolve().parents[2] / "configs" / "run.toml"
    args, _ = parse_train_args(["--config", str(shipped), "--model", "llama3-8b"])
    assert (args.num_layers, args.hidden_size) == (32, 4096)  # run.toml carries no sizes: --model decides


def test_a_sequence_longer_than_the_position_table_is_refused_before_any_work():
    args, _ = parse_train_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                "--seq-length", "256", "--max-position-embeddings", "128"])
    with pytest.raises(ArgumentError, match="--seq-length 256 is longer than --max-position-embeddings 128"):
        model_config(args, 256)
    args = dataclasses.replace(args, max_position_embeddings=None)  # the table follows --seq-length
    assert model_config(args, 256).max_seq_len == 256


@pytest.mark.parametrize("line, message", [
    ('bf16 = "false"', r"bf16 = 'false' is a string, but --bf16 takes a boolean. Fix: write bf16 = true or false"),
    ('train_iters = "3"', r"train_iters = '3' is a string, but --train-iters takes an integer"),
    ("train_iters = 3.0", r"train_iters = 3.0 is a number, but --train-iters takes an integer"),
    ('data_path = "x"', r"data_path = 'x' is a string, but --data-path takes a list. Fix: write data_path = \["),
    ("lr = true", r"lr = True is a boolean, but --lr takes a number"),
    ('tokenizer_type = ["byte"]', r"tokenizer_type = \['byte'\] is a list, but --tokenizer-type takes a string"),
])
def test_toml_values_are_type_checked_like_flags(tmp_path, line, message):
    """TOML arrives typed: a quoted "false" is a true string, a string data_path would be read
    character by character. Each is refused, naming the key and the fix."""
    config = tmp_path / "run.toml"
    config.write_text(line + "\n")
    with pytest.raises(ArgumentError, match=message):
        parse_train_args(["--config", str(config)])


def test_toml_numbers_for_text_options_read_as_the_command_line_would(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("moe_layer_freq = 2\nlr = 3\nsplit = \"98,2,0\"\n")
    args, _ = parse_train_args(["--config", str(config)])
    assert args.moe_layer_freq == "2" and args.lr == 3 and args.split_weights == (98.0, 2.0, 0.0)


@pytest.mark.parametrize("flags, message", [
    ("--micro-batch-size 0 --global-batch-size 0", r"--micro-batch-size 0: must be at least 1.*or leave it out"),
    ("--global-batch-size 0", r"--global-batch-size 0: must be at least 1"),
    ("--train-iters 0", r"--train-iters 0: must be at least 1"),
    ("--seq-length 0", r"--seq-length 0: must be at least 1"),
    ("--tensor-model-parallel-size 0", r"--tensor-model-parallel-size 0: must be at least 1"),
    ("--rotary-base -1", r"--rotary-base -1.0: must be greater than 0"),
    ("--init-method-std 0", r"--init-method-std 0.0: must be greater than 0"),
    ("--lr -0.1", r"--lr -0.1: must be 0 or more"),
    ("--eval-iters -1", r"--eval-iters -1: must be 0 or more"),
    ("--lr nan", r"--lr nan: must be a finite number"),
    ("--distributed-timeout-minutes 0", r"--distributed-timeout-minutes 0.0: must be greater than 0"),
    ("--straggler-minmax-count 0", r"--straggler-minmax-count 0: must be at least 1"),
    # matrix 3, A4: past int64 reached numpy's index builder
    ("--train-iters 99999999999999999999", r"--train-iters 99999999999999999999: beyond the largest whole number"),
])
def test_sizes_and_counts_that_mean_nothing_are_refused_by_flag(flags, message):
    """Before: a zero micro- and global batch silently became 1 and 2, --train-iters 0 was
    blamed on --split, a negative rotary base trained on NaN losses."""
    with pytest.raises(ArgumentError, match=message):
        parse_train_args(["--train-iters", "5", "--lr", "1e-3", *flags.split()])


def test_the_arguments_are_sections_that_own_their_flags_and_checks_and_cannot_be_changed():
    """TrainArgs is the sum of its sections (model, parallel, custom plan, pipeline, fusion, fp8, moe,
    optimizer, data, checkpoint, logging, Megatron-only, launch): each field is declared in exactly one, each range
    check names a field of its own section, and the parsed result is immutable (what start-up
    derives is a new value)."""
    from dataclasses import FrozenInstanceError, fields

    from dtmega.train import args as module

    sections = [cls for cls in module.TrainArgs.__mro__[1:] if cls is not object]
    assert len(sections) == 13
    owners = {}
    for section in sections:
        own = {f.name for f in fields(section)}
        for name in own:
            owners.setdefault(name, []).append(section.__name__)
        for group in ("at_least_one", "at_least_zero", "positive"):
            assert set(vars(section).get(group, ())) <= own, (section.__name__, group)
    assert set(owners) == {f.name for f in fields(module.TrainArgs)}
    assert all(len(names) == 1 for names in owners.values())
    args, _ = parse_train_args(["--lr", "1e-3"])
    with pytest.raises(FrozenInstanceError):
        args.lr = 2e-3
    assert dataclasses.replace(args, lr=2e-3).lr == 2e-3 and args.lr == 1e-3


def test_every_megatron_flag_that_torch_already_covers_is_accepted_with_its_note():
    """Each noted flag parses (with its value where it takes one) and says why it changes
    nothing here, one line each."""
    from dtmega.train.args import _NOTED_WITH_VALUE, NOTED_FLAGS

    for name, reason in NOTED_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        argv = [flag, "x"] if name in _NOTED_WITH_VALUE else [flag]
        _, notes = parse_train_args(argv)
        assert notes == [f"{flag} accepted: {reason}"], flag


def test_use_torch_fsdp2_is_fully_sharded_data_parallelism():
    args = parse_train_args(["--use-torch-fsdp2", "--swiglu", "--num-layers", "2"])[0]
    plan = build_plan(args, run_shape(args, 4), 2)
    assert [p.mode for p in plan.passes if isinstance(p, DataParallel)] == ["fsdp"]
    with pytest.raises(ArgumentError, match="--use-torch-fsdp2 and --data-parallel ddp disagree"):
        args = parse_train_args(["--use-torch-fsdp2", "--data-parallel", "ddp"])[0]
        args.data_parallel_mode()


@pytest.mark.parametrize("text, weights", [("'99,1,0'", (99.0, 1.0, 0.0)), ("969,30,1", (969.0, 30.0, 1.0)),
                                           ("99/1/0", (99.0, 1.0, 0.0)), ("98,2", (98.0, 2.0, 0.0)),
                                           ("100", (100.0, 0.0, 0.0))])
def test_split_is_read_as_megatron_reads_it(text, weights):
    """Megatron takes the numbers in --split's text: its FP8 example's `--split '99,1,0'` reaches
    the program with the quotes when the line is copied into a config."""
    assert parse_train_args(["--split", text])[0].split_weights == weights


@pytest.mark.parametrize("text", ["abc", "1,2,3,4", "0,0,0", "9x,1"])
def test_a_split_that_means_nothing_is_refused(text):
    with pytest.raises(ArgumentError, match="--split"):
        parse_train_args(["--split", text])[0].split_weights


@pytest.mark.parametrize("typed, hint", [("--hiden-size", "--hidden-size"), ("--num-layer", "--num-layers"),
                                         ("--train-smaples", "--train-samples"), ("--ckpt-formt", "--ckpt-format")])
def test_a_mistyped_flag_gets_the_flag_it_meant(typed, hint):
    with pytest.raises(ArgumentError, match=f"{typed}: did you mean {hint}"):
        parse_train_args([typed, "1"])


@pytest.mark.parametrize("typed", ["--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm", "--moe-upcycling-x"])
def test_an_unknown_flag_gets_no_hint_that_names_something_else(typed):
    """Megatron's flags dtmega lacks: a guess must share their first word, so `--decoupled-lr`
    is not offered `--compile` (as `--decoupled-lr` once was)."""
    with pytest.raises(ArgumentError) as caught:
        parse_train_args([typed, "1"])
    message = str(caught.value)
    for wrong in ("--compile", "--fp8-", "--moe-layer-freq"):
        assert f"did you mean {wrong}" not in message, message


def test_recompute_activations_is_selective_recompute():
    args = parse_train_args(["--recompute-activations"])[0]
    plan = build_plan(args, run_shape(args, 4), 2)
    assert [p.policy for p in plan.passes if isinstance(p, Recompute)] == ["selective"]
    with pytest.raises(ArgumentError, match="--recompute-activations \\(selective\\) and --recompute-granularity full"):
        args = parse_train_args(["--recompute-activations", "--recompute-granularity", "full"])[0]
        build_plan(args, run_shape(args, 4), 2)


def test_a_toml_integer_past_int64_is_refused_by_key(tmp_path):
    """Matrix 3, A4: `train_iters = 99999999999999999999` in a TOML file ran until killed."""
    (tmp_path / "big.toml").write_text("train_iters = 99999999999999999999\n")
    with pytest.raises(ArgumentError, match=r"--train-iters 99999999999999999999: beyond the largest whole number"):
        parse_train_args(["--config", str(tmp_path / "big.toml"), "--lr", "1e-3"])


def test_the_reliability_defaults_are_megatrons():
    """docs/reliability.md: "`--max-skipped-steps` (default 10)" (the check itself on by default)
    and "`--distributed-timeout-minutes` (Megatron's flag, default 10)" are what a bare command
    line parses to, and what the trainer is handed."""
    args, _ = parse_train_args([])
    assert args.max_skipped_steps == 10
    assert args.no_check_for_nan_in_loss_and_grad is False
    assert args.distributed_timeout_minutes == 10


def test_run_toml_and_the_readme_make_a_self_healing_job():
    """docs/reliability.md, Restarts: "The README's SLURM example adds `--max-restarts 3` to a job
    whose `configs/run.toml` names one directory as `--save` and `--load`": a restarted worker
    resumes by itself only if both hold."""
    root = Path(__file__).resolve().parents[2]
    args, _ = parse_train_args(["--config", str(root / "configs" / "run.toml")])
    assert args.save and args.save == args.load
    readme = (root / "README.md").read_text()
    after = readme[readme.index("# the same job, self-healing"):]
    command = after[:after.index("\n\n")].replace("\\\n", " ")
    command = command[command.index("srun torchrun"):]  # the line after the comment, continuations joined
    assert " --max-restarts 3 " in command
    assert "--config configs/run.toml" in command
