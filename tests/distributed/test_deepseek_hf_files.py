"""DeepSeek-V3 Hugging Face checkpoints read under sharded plans on 4 ranks (issue 35 item 5):
a tiny `DeepseekV3ForCausalLM` saved by transformers is read slice by slice under TP2 + SP
(MLA's projections split by heads; the latent and rotary key whole), EP4 with its groups (each
rank reads its two experts of every MoE block) and FSDP4 (rows split anywhere); each gives
transformers' logits. The FP8 block-quantized copy read under FSDP4 and TP2 (scale tiles
straddling the shards' edges) equals the dequantized checkpoint read whole.

Tolerance: logits within 1e-5 relative (max |difference| / max |logit|, fp32: only the order of
the reductions differs, ~3e-7 measured on one rank); the FP8 reads bitwise (no arithmetic but
the dequantization, done the same way on any region).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtmega
from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.passes import DataParallel, ExpertParallel, Plan, SequenceParallel, TensorParallel
from tests.helpers import full, mesh

LOGITS_RTOL = 1e-5


def relative_max(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def deepseek_dirs(shared_dir):
    """(the transformers-made directory, its FP8 copy), written once by rank 0."""
    from tests.hf_models import quantize_fp8_blocks, save_tiny_deepseek_v3

    plain, quantized = shared_dir / "deepseek_hf", shared_dir / "deepseek_hf_fp8"
    if dist.get_rank() == 0 and not plain.exists():
        save_tiny_deepseek_v3(plain, seed=3)
        quantize_fp8_blocks(plain, quantized)
    dist.barrier()
    return plain, quantized


def load_under(directory, plan_mesh, passes: list):
    checkpoint = HFCheckpoint.open(directory)
    with torch.device("meta"):
        model = checkpoint.architecture.build(checkpoint.config)
    pm = dtmega.parallelize(model, plan_mesh, Plan(passes))
    pm.materialize()
    checkpoint.load_into(pm.module)
    return pm.eval()


PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "ep4_groups": (dict(ep=4), [ExpertParallel(), DataParallel("fsdp")]),
    "fsdp4": (dict(dp_shard=4), [DataParallel("fsdp")]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_deepseek_checkpoint_under_a_plan_gives_transformers_logits(name, deepseek_dirs):
    from transformers import AutoModelForCausalLM

    plain, _ = deepseek_dirs
    sizes, passes = PLANS[name]
    pm = load_under(plain, mesh(**sizes), passes)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(dist.get_rank() // 2))  # a TP pair alike
    with torch.no_grad():
        ours = full(pm.forward(ids))
        theirs = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()(ids, use_cache=False).logits
    assert relative_max(ours, theirs) < LOGITS_RTOL
    if name == "ep4_groups":  # each rank holds 2 of the 8 experts: 4 groups of 2 on 4 ranks
        experts = dict(pm.named_parameters())["layers.1.feed_forward.experts.w1"]
        assert experts.to_local().shape[0] == 2


@pytest.mark.parametrize("name", ["fsdp4", "tp2_sp"])
def test_fp8_checkpoint_read_in_shards_equals_the_whole_dequantized_read(name, deepseek_dirs):
    """Every tensor of the FP8 copy read under the plan (each rank dequantizing only its
    region) equals the same tensor read whole on one rank, bitwise."""
    _, quantized = deepseek_dirs
    sizes, passes = PLANS[name]
    pm = load_under(quantized, mesh(**sizes), passes)
    checkpoint = HFCheckpoint.open(quantized)
    with torch.device("meta"):
        whole = checkpoint.architecture.build(checkpoint.config)
    whole.to_empty(device="cpu")
    checkpoint.load_into(whole)
    expected = whole.state_dict()
    for fqn, tensor in pm.module.state_dict().items():
        assert torch.equal(full(tensor), expected[fqn]), fqn


def test_train_load_hf_fine_tunes_the_deepseek_checkpoint_under_ep4_and_saves_it_for_transformers(deepseek_dirs,
                                                                                                  shared_dir):
    """`dtmega train --load-hf` on the transformers-made DeepSeek under EP4 (flex dispatcher, the
    groups on the ranks) with its own tokenizer, on random tokens (the random model already
    sits at their entropy, so the loss cannot fall): the first loss is the model's own on
    them (ln of the 320 rows, within 1 %), the run steps, and `--save-hf` writes a directory
    transformers loads, whose logits are the fine-tuned model's (not the source's)."""
    import json
    import math

    from transformers import AutoModelForCausalLM

    from tests.train_helpers import train_reusing_meshes

    plain, _ = deepseek_dirs
    log, save, exported = shared_dir / "deepseek_ft.jsonl", shared_dir / "deepseek_ft", shared_dir / "deepseek_ft_hf"
    argv = ["--load-hf", str(plain), "--mock-data", "--seq-length", "32", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--train-iters", "6", "--lr", "3e-3", "--min-lr", "3e-3",
            "--lr-warmup-iters", "0", "--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "flex",
            "--eval-iters", "0", "--log-interval", "1", "--log-file", str(log), "--save", str(save),
            "--save-interval", "6", "--save-hf", str(exported), "--seed", "3"]
    result = train_reusing_meshes(argv)
    assert abs(result.losses[0] - math.log(320)) < 0.01 * math.log(320) and all(map(math.isfinite, result.losses))
    dist.barrier()
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(8))
    trained = load_under(exported, mesh(dp_shard=4), [DataParallel("fsdp")])
    with torch.no_grad():
        ours = full(trained.forward(ids))
        theirs = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()(ids, use_cache=False).logits
        source = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()(ids, use_cache=False).logits
    assert relative_max(ours, theirs) < LOGITS_RTOL and relative_max(theirs, source) > 1e-3  # trained, and read back
    if dist.get_rank() == 0:
        assert json.loads((exported / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
