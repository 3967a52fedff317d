"""`dtmega train` on 4 ranks: exact resume, checkpoints under other plans (TP2 -> TP4,
TP2 -> FSDP4, 4 ranks -> 1 rank), validation vs `dtmega evaluate`, generation under TP, and
mixed precision."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dtmega.train.generate import generate_tokens
from dtmega.train.restore import restore
from tests.helpers import assert_same_choices, mesh, relative_error
from tests.train_helpers import tiny_args
from tests.train_helpers import train_reusing_meshes as train


@pytest.fixture(scope="module")
def twenty_steps(corpus, shared_dir):
    """TP2 x FSDP2, 20 steps, checkpoints at 10 and 20."""
    save = shared_dir / "tp2_fsdp2"
    result = train(tiny_args(corpus, tensor_model_parallel_size=2, sequence_parallel=True,
                             use_distributed_optimizer=True, save=save, save_interval=10))
    return result, save


def test_resume_reproduces_the_loss_sequence_exactly(corpus, twenty_steps, shared_dir):
    full, save = twenty_steps
    resumed = train(tiny_args(corpus, tensor_model_parallel_size=2, sequence_parallel=True,
                              use_distributed_optimizer=True, load=save / "iter_0000010"))
    assert len(full.losses) == 20 and len(resumed.losses) == 10
    # Exact: the same plan on the same ranks runs the same kernels in the same order, so a resume
    # that restores every state (weights, optimizer, data position, RNG) is bit-identical.
    assert resumed.losses == full.losses[10:]
    assert full.losses[-1] < full.losses[0] - 1.0


@pytest.mark.parametrize("sizes", [dict(tp=4), dict(dp_shard=4), dict(tp=2, dp_shard=2)], ids=["tp4", "fsdp4", "tp2_fsdp2"])
def test_checkpoint_weights_load_under_another_plan(twenty_steps, sizes):
    _, save = twenty_steps
    reference, _, _ = restore(save, mesh=mesh(tp=1))
    expected = reference.full_state_dict()
    data_parallel = "fsdp" if sizes.get("dp_shard", 1) > 1 else None
    pm, _, state = restore(save, tp=sizes.get("tp", 1), data_parallel=data_parallel, mesh=mesh(**sizes))
    assert state["iteration"] == 20
    for name, value in pm.full_state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("plan", [dict(tensor_model_parallel_size=4), dict(use_distributed_optimizer=True)], ids=["tp4", "fsdp4"])
def test_training_continues_under_another_plan(corpus, twenty_steps, plan):
    full, save = twenty_steps
    continued = train(tiny_args(corpus, load=save / "iter_0000010", **plan))
    # Optimizer state is resharded too: a fresh Adam would step very differently. Other plans sum
    # in other orders: fp32 roundoff, the suite's 1e-5.
    assert all(relative_error(torch.tensor(a), torch.tensor(b)) < 1e-5 for a, b in zip(continued.losses, full.losses[10:]))


def test_validation_loss_equals_evaluate_on_one_rank_and_four(corpus, twenty_steps, shared_dir):
    full, save = twenty_steps
    step, val_loss = full.validation[0]
    assert step == 10 and [s for s, _ in full.validation] == [10, 20]
    assert full.validation[1][1] != val_loss  # each validation reads on where the last one stopped (Megatron's)
    save = save / "iter_0000010"
    from dtmega.train.evaluate import main as evaluate

    # No --split/--eval-iters/--global-batch-size: on the run's own data evaluate defaults to the
    # run's validation settings, from the validation data's first sample: the step-10 checkpoint's
    # evaluation is the run's first validation (the validation part is one epoch, whose order does
    # not depend on how many samples are asked of it).
    four = evaluate(["--load", str(save), "--data-path", corpus, "--tensor-model-parallel-size", "2"])
    # The same TP2 forward on the same weights, only the data-parallel split of the sum differs.
    assert abs(four - val_loss) / val_loss < 1e-6
    outcome = [None]
    if dist.get_rank() == 0:  # a world of one, in its own process
        command = [sys.executable, "-m", "dtmega", "evaluate", "--load", str(save), "--data-path", corpus]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240,
                              env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
        outcome = [done.stdout + done.stderr]
    dist.broadcast_object_list(outcome, src=0)
    one = float(outcome[0].split("loss ")[1].split(",")[0])
    # One rank sums every matmul in another order than TP2 and prints 4 decimals: 1e-4.
    assert abs(one - val_loss) / val_loss < 1e-4, outcome[0]


def test_generation_under_tp_matches_one_rank(twenty_steps):
    _, save = twenty_steps
    runs = []
    for sizes in (dict(tp=1), dict(tp=2)):
        pm, tokenizer, _ = restore(save, tp=sizes["tp"], mesh=mesh(**sizes))
        common = dict(vocab_size=tokenizer.vocab_size, eod=tokenizer.eod, max_new_tokens=24)
        prompt = tokenizer.encode("The lord")
        runs.append((generate_tokens(pm.module, prompt, temperature=0.0, **common),
                     generate_tokens(pm.module, prompt, temperature=1.0, top_k=20, seed=3, **common)))
    # TP sums in another order: tokens are equal unless a choice was a near tie (tests/helpers.py).
    for one_rank, tp2 in zip(*runs):
        assert len(one_rank.ids) > 0
        assert_same_choices(one_rank, tp2)


@pytest.mark.parametrize("precision", [{"bf16": True}, {"fp16": True, "initial_loss_scale": 1024}], ids=["bf16", "fp16"])
def test_mixed_precision_trains(corpus, precision):
    result = train(tiny_args(corpus, tensor_model_parallel_size=2, use_distributed_optimizer=True, train_iters=12,
                             lr=5e-3, **precision))
    assert all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0] - 0.5


@pytest.fixture(scope="module")
def pipelined(corpus, shared_dir):
    """PP2 x TP2 (interleaved, uneven-free), 12 steps, checkpoint at the end."""
    save = shared_dir / "pp2_tp2"
    result = train(tiny_args(corpus, num_layers=4, pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                             sequence_parallel=True, untie_embeddings_and_output_weights=True, train_iters=12,
                             global_batch_size=8, micro_batch_size=2, num_layers_per_virtual_pipeline_stage=1,
                             save=save))
    return result, save


def test_pipelined_training_matches_data_parallel_training(corpus, pipelined):
    reference = train(tiny_args(corpus, num_layers=4, untie_embeddings_and_output_weights=True, train_iters=12,
                                global_batch_size=8, micro_batch_size=2, tensor_model_parallel_size=2,
                                use_distributed_optimizer=True))
    result, _ = pipelined
    assert len(result.losses) == 12
    errors = [relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(result.losses, reference.losses)]
    assert max(errors) < 1e-5, errors
    assert abs(result.validation[-1][1] - reference.validation[-1][1]) / reference.validation[-1][1] < 1e-5


@pytest.mark.parametrize("sizes", [dict(tp=1), dict(tp=4)], ids=["pp2tp2_to_pp1", "pp2tp2_to_tp4"])
def test_pipelined_checkpoint_loads_without_pipelining(pipelined, sizes):
    _, save = pipelined
    reference, _, state = restore(save, mesh=mesh(tp=1))
    assert state["iteration"] == 12 and len(reference.full_state_dict()) == 4 * 9 + 3
    pm, _, _ = restore(save, tp=sizes["tp"], mesh=mesh(**sizes))
    expected = reference.full_state_dict()
    for name, value in pm.full_state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_resume_a_pipelined_run_under_another_pipeline(corpus, pipelined, shared_dir):
    result, save = pipelined
    resumed = train(tiny_args(corpus, num_layers=4, pipeline_model_parallel_size=4,
                              untie_embeddings_and_output_weights=True, train_iters=14, global_batch_size=8,
                              microbatches=4, pipeline_schedule="gpipe", load=save))
    assert len(resumed.losses) == 2 and all(math.isfinite(x) for x in resumed.losses)


SIX_STEPS = dict(num_layers=2, train_iters=6, global_batch_size=8, micro_batch_size=2, tensor_model_parallel_size=2,
                 use_distributed_optimizer=True, eval_interval=6)


@pytest.fixture(scope="module")
def tp2_fsdp2_six_steps(corpus):
    """The reference the context-parallel runs are compared with."""
    return train(tiny_args(corpus, **SIX_STEPS))


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_context_parallel_training_matches_data_parallel_training(corpus, comm, tp2_fsdp2_six_steps):
    reference = tp2_fsdp2_six_steps
    result = train(tiny_args(corpus, context_parallel_size=2, cp_comm_type=comm, sequence_parallel=True,
                             **{**SIX_STEPS, "micro_batch_size": 4}))
    errors = [relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(result.losses, reference.losses)]
    assert max(errors) < 1e-5, errors
    assert abs(result.validation[-1][1] - reference.validation[-1][1]) / reference.validation[-1][1] < 1e-5


def test_moe_training_with_expert_parallelism_matches_data_parallel_training(corpus, shared_dir):
    """EP2 x FSDP2 equals FSDP4 step for step (balancing losses and expert-bias steps included),
    its checkpoint resumes under FSDP4 as FSDP4's own does, and the expert load reaches
    metrics.jsonl and TensorBoard."""
    log, board = shared_dir / "moe" / "metrics.jsonl", shared_dir / "moe" / "tb"
    saves = {name: shared_dir / "moe" / name for name in ("fsdp4", "ep2")}
    common = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2,
                  moe_z_loss_coeff=1e-3, moe_router_enable_expert_bias=True, moe_grouped_gemm=True, train_iters=6,
                  use_distributed_optimizer=True, eval_interval=6, log_interval=3)
    reference = train(tiny_args(corpus, save=saves["fsdp4"], **common))
    result = train(tiny_args(corpus, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                             log_file=str(log), tensorboard_dir=str(board), save=saves["ep2"], **common))
    errors = [relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(result.losses, reference.losses)]
    assert len(errors) == 6 and max(errors) < 1e-5, errors
    resumed = {name: train(tiny_args(corpus, load=path, **{**common, "train_iters": 8})).losses
               for name, path in saves.items()}
    assert len(resumed["ep2"]) == 2
    assert max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(*resumed.values())) < 1e-5
    runs = []
    for sizes in (dict(tp=1), dict(tp=2)):  # generation from the EP checkpoint, with the experts under TP too
        pm, tokenizer, state = restore(saves["ep2"], tp=sizes["tp"], mesh=mesh(**sizes))
        assert state["model_config"]["moe"]["num_experts"] == 4
        runs.append(generate_tokens(pm.module, tokenizer.encode("The lord"), vocab_size=tokenizer.vocab_size,
                                    eod=tokenizer.eod, max_new_tokens=16, temperature=0.0))
    assert len(runs[0].ids) > 0
    assert_same_choices(*runs)
    if dist.get_rank() == 0:
        records = [json.loads(line) for line in log.read_text().splitlines() if '"loss"' in line]
        assert [r["step"] for r in records] == [3, 6]
        for record in records:
            assert record["moe_loss"] > 0 and record["dropped"] == 0 and record["expert_load_max"] >= 1
            loads = record["expert_load"]
            assert sorted(loads) == ["layers.0.feed_forward", "layers.1.feed_forward"]
            assert all(len(load) == 4 and abs(sum(load) - 1) < 1e-6 for load in loads.values())
        assert list(board.glob("events.out.tfevents.*"))


def test_a_mesh_of_other_sizes_than_the_arguments_is_refused(corpus):
    from dtmega.train.args import ArgumentError
    from dtmega.train.trainer import train as train_on

    with pytest.raises(ArgumentError, match="the mesh given has the sizes"):
        train_on(tiny_args(corpus, tensor_model_parallel_size=2, train_iters=1), mesh=mesh(tp=4))


def test_a_user_registered_hugging_face_model_trains_by_name(corpus, shared_dir):
    """`dtmega train --custom-import tests.user_models --model hf-tiny-llama` (a ModelSpec
    registered outside the package) trains under TP2 x DDP2, saves, and evaluates by name."""
    save = shared_dir / "hf_tiny"
    argv = ["--custom-import", "tests.user_models", "--model", "hf-tiny-llama", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--data-path", corpus, "--split", "90,10,0",
            "--tokenizer-type", "byte", "--eval-interval", "8", "--eval-iters", "2", "--log-interval", "4",
            "--save", str(save)]
    result = train(argv)
    assert len(result.losses) == 8 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0] - 0.5, result.losses
    from dtmega.train.evaluate import main as evaluate

    loss = evaluate(["--load", str(save), "--data-path", corpus, "--tensor-model-parallel-size", "2",
                     "--custom-import", "tests.user_models"])
    assert abs(loss - result.validation[-1][1]) / loss < 1e-5


def test_divergence_stops_every_rank_at_the_same_step(corpus, shared_dir):
    """TP2 x FSDP2 with --lr 1e6: the loss and the gradient norm are reduced over the job, so
    every rank sees the same non-finite streak and stops at the same step with the same message
    (no rank is left waiting in a collective); no checkpoint is written inside the streak."""
    from dtmega.train.divergence import TrainingDiverged

    save = shared_dir / "diverged"
    with pytest.raises(TrainingDiverged) as caught:
        train(tiny_args(corpus, tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True,
                        lr=1e6, lr_warmup_iters=0, clip_grad=0, max_skipped_steps=3, train_iters=30, save=save,
                        save_interval=1))
    message = str(caught.value)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, message)
    assert len(set(everyone)) == 1 and "(3 in a row, --max-skipped-steps 3)" in message
    first_bad = int(message.split("not finite at steps ")[1].split("-")[0])
    assert all(int(path.name.removeprefix("iter_")) < first_bad for path in save.glob("iter_*"))


def test_a_damaged_shard_of_one_rank_falls_back_on_every_rank(corpus, twenty_steps, shared_dir):
    """400 bytes inverted in the shard rank 3 wrote into iter_20: the checksums (dealt out over
    the four ranks, one verdict gathered to all) reject iter_20 on every rank, and the resume
    from the --save directory continues from iter_10 with the uninterrupted losses, exactly."""
    import shutil

    full, save = twenty_steps
    copy = shared_dir / "damaged_tp2_fsdp2"
    if dist.get_rank() == 0:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(save, copy)
        shard = copy / "iter_0000020" / "__3_0.distcp"
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 400] = bytes(b ^ 0xFF for b in data[middle:middle + 400])
        shard.write_bytes(bytes(data))
    dist.barrier()
    resumed = train(tiny_args(corpus, tensor_model_parallel_size=2, sequence_parallel=True,
                              use_distributed_optimizer=True, load=copy))
    assert resumed.losses == full.losses[10:]


def test_a_tied_pipelined_checkpoint_holds_the_embedding_once_and_resumes_exactly(corpus, shared_dir):
    """PP2 x DP2 with the embedding tied across the stages (the last stage holds a copy): the
    checkpoint holds the tied matrix and its optimizer state once (as Megatron's holds its word
    embedding once), the copy is filled from it on load, a resume from step 2 repeats the
    uninterrupted run's losses, and restored without pipelining the output layer is the embedding."""
    from dtmega.checkpoint_reader import read_dcp_metadata

    save = shared_dir / "pp2_tied"
    args = dict(num_layers=4, pipeline_model_parallel_size=2, train_iters=4, global_batch_size=8, micro_batch_size=2,
                eval_iters=0)
    whole = train(tiny_args(corpus, save=save, save_interval=2, **args))
    keys = set(read_dcp_metadata(save / "iter_0000002").state_dict_metadata)
    assert "model.tok_embeddings.weight" in keys and "model.output.weight" not in keys
    assert not [key for key in keys if ".output.weight." in key]  # no optimizer state of the copy
    assert any(key.startswith("optimizer.state.tok_embeddings.weight.") for key in keys)
    resumed = train(tiny_args(corpus, load=save / "iter_0000002", **args))
    assert resumed.losses == whole.losses[2:]
    pm, _, _ = restore(save, mesh=mesh(tp=1))
    state = pm.full_state_dict()
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])


def test_a_folded_expert_checkpoint_resumes_under_expert_tensor_parallelism(corpus, shared_dir):
    """ETP 1 (experts whole, folded over TP x EP) saves each expert once; the checkpoint resumes
    exactly under the same plan, and loads under ETP = TP (each expert's hidden dim split over
    TP instead) with the same weights."""
    save = shared_dir / "etp1"
    args = dict(num_layers=2, tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                num_experts=4, moe_router_topk=2, train_iters=4, global_batch_size=8, micro_batch_size=2,
                use_distributed_optimizer=True, eval_iters=0)
    whole = train(tiny_args(corpus, save=save, save_interval=2, expert_tensor_parallel_size=1, **args))
    resumed = train(tiny_args(corpus, load=save / "iter_0000002", expert_tensor_parallel_size=1, **args))
    assert resumed.losses == whole.losses[2:]
    other = train(tiny_args(corpus, load=save / "iter_0000002", **{**args, "train_iters": 3}))
    assert len(other.losses) == 1 and abs(other.losses[0] - whole.losses[2]) < 1e-4 * abs(whole.losses[2])
