"""dtmega's DeepSeek-V3 family against transformers' DeepseekV3ForCausalLM (the ground truth):
a tiny random config with every feature on (low-rank queries, YaRN RoPE with mscale, groups,
shared experts, a dense first block), weights moved by the family's name map; logits equal in
fp32 (1e-5 relative: same math, different summation order) and greedy generation
token-identical with and without the latent KV cache, whose bytes per token are the closed
form. Also the routing rules and the named sizes' parameter counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtmega.models.deepseek import DeepSeek, DeepSeekConfig
from dtmega.models.deepseek.hf_config import deepseek_config_from_hf, hf_config_from_deepseek
from dtmega.models.deepseek.hf_names import dtmega_state_from_hf, hf_state_from_dtmega
from dtmega.models.kv_cache import KVCache
from dtmega.models.moe_config import MoEConfig
from dtmega.models.router import limit_to_best_groups
from dtmega.train.generate import generate_tokens
from tests.helpers import relative_error


def tiny_hf_config(**overrides):
    from transformers import DeepseekV3Config

    settings = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4,
        topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=256, rope_interleave=True, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 0.8},
    )
    settings.update(overrides)
    return DeepseekV3Config(**settings)


def hf_and_dtmega(seed: int = 0, **overrides):
    """transformers' model with random weights (and a nonzero expert bias) and dtmega's with the
    same weights, both fp32 in eval mode."""
    from transformers import DeepseekV3ForCausalLM

    hf_config = tiny_hf_config(**overrides)
    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            tensor.normal_(0, 0.02 if tensor.ndim > 1 else 0.2).add_(1.0 if tensor.ndim == 1 else 0.0)
        for module in hf.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    config = deepseek_config_from_hf(hf_config.to_dict())
    ours = DeepSeek(config)
    state = dtmega_state_from_hf(hf.state_dict(), config, rope_interleave=hf_config.rope_interleave)
    ours.load_state_dict(state, strict=True)
    return hf, ours.eval(), config


@pytest.mark.parametrize("interleave", [True, False], ids=["rope_interleave", "rope_half_split"])
def test_logits_equal_transformers_deepseek_v3(interleave):
    hf, ours, config = hf_and_dtmega(rope_interleave=interleave)
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=tokens, use_cache=False).logits
        got = ours(tokens)
    assert relative_error(got, expected) <= 1e-5
    assert config.yarn is not None and config.moe.num_groups == 4 and config.q_lora_rank == 24


def test_greedy_generation_is_token_identical_with_and_without_the_latent_cache():
    hf, ours, config = hf_and_dtmega(seed=3)
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2)).tolist()[0]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        cached = generate_tokens(ours, prompt, vocab_size=128, eod=None, max_new_tokens=12, temperature=0.0).ids
        tokens = list(prompt)
        for _ in range(12):  # no cache: the whole sequence every step
            tokens.append(int(ours(torch.tensor([tokens]))[0, -1].argmax()))
    assert cached == expected == tokens[len(prompt):]
    cache = KVCache(16)
    with torch.no_grad():
        ours(torch.tensor([prompt]), cache=cache)
    layer = cache.layers["0"]
    per_token = (layer.keys[0, 0].numel() + layer.values[0, 0].numel()) * layer.keys.element_size()
    assert per_token == config.kv_cache_bytes_per_token(bytes_per_value=4) == (16 + 8) * 4
    assert config.mha_cache_bytes_per_token(4) == 4 * (24 + 12) * 4  # 6x more for this tiny model


def test_export_to_transformers_round_trips():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf, ours, config = hf_and_dtmega(seed=5)
    exported = DeepseekV3ForCausalLM(DeepseekV3Config(**hf_config_from_deepseek(config))).float().eval()
    missing, unexpected = exported.load_state_dict(_fused(hf_state_from_dtmega(ours.state_dict(), config), config),
                                                   strict=False)
    assert not unexpected and all("rotary_emb" in name for name in missing), (missing, unexpected)
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert relative_error(exported(input_ids=tokens).logits, hf(input_ids=tokens).logits) <= 1e-6


def _fused(state: dict, config: DeepSeekConfig) -> dict:
    """The per-expert checkpoint layout as transformers holds experts in memory."""
    out = {}
    for name, tensor in state.items():
        if ".mlp.experts." not in name:
            out[name] = tensor
    for i in range(config.n_layers):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" in state:
            experts = range(config.moe.num_experts)
            gate = torch.stack([state[f"{p}{e}.gate_proj.weight"] for e in experts])
            up = torch.stack([state[f"{p}{e}.up_proj.weight"] for e in experts])
            out[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
            out[p + "down_proj"] = torch.stack([state[f"{p}{e}.down_proj.weight"] for e in experts])
    return out


def test_group_limited_routing_picks_experts_from_the_best_groups_only():
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(64, 16, generator=generator)
    limited = limit_to_best_groups(scores, num_groups=4, group_topk=2)
    chosen = limited.topk(4, dim=-1).indices
    groups = chosen // 4
    assert all(len(set(row)) <= 2 for row in groups.tolist())
    best_pairs = scores.view(64, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices.sort().values
    assert torch.equal(torch.isfinite(limited).view(64, 4, 4).any(-1).nonzero()[:, 1].view(64, 2), best_pairs)


def test_bad_group_settings_are_refused_naming_the_fix():
    with pytest.raises(Exception, match="group_topk=5 must be between 1 and num_groups=4"):
        MoEConfig(num_experts=8, top_k=2, num_groups=4, group_topk=5)
    with pytest.raises(Exception, match="num_experts=8 is not divisible by num_groups=3"):
        MoEConfig(num_experts=8, top_k=2, num_groups=3, group_topk=1)
    with pytest.raises(Exception, match="needs both num_groups"):
        MoEConfig(num_experts=8, top_k=2, num_groups=4)


def test_named_sizes_have_the_published_parameter_counts():
    """DeepSeek-V3: 671 B parameters, 37 B activated per token (without its MTP module, as
    published); DeepSeek-V2-Lite: 15.7 B, 2.4 B activated. Counted from the shapes, and for the
    debug size also from the built model."""
    v3, lite, debug = (DeepSeekConfig.from_name(n) for n in ("deepseek-v3", "deepseek-v2-lite", "deepseek-debug"))
    assert round(v3.num_params() / 1e9) == 671 and round(v3.num_activated_params() / 1e9) == 37
    assert round(lite.num_params() / 1e8) == 157 and int(lite.num_activated_params() / 1e8) == 24
    model = DeepSeek(debug)  # with its MTP module
    assert sum(p.numel() for p in model.parameters()) == debug.num_params(with_mtp=True) > debug.num_params()
    assert v3.kv_cache_bytes_per_token() == (512 + 64) * 2 and v3.mha_cache_bytes_per_token() == 128 * 320 * 2


def test_groups_that_do_not_map_onto_expert_parallel_ranks_are_refused_before_launch():
    """12 experts in 4 groups of 3 over EP3: a rank would hold parts of two groups, so groups
    could not bound the ranks a token reaches; PlanError naming the EP sizes that work."""
    import dtmega
    from dtmega.passes import DataParallel, ExpertParallel, PlanError
    from tests.helpers import mesh_shape

    config = DeepSeekConfig.from_name("deepseek-debug", mtp_num_layers=0)
    config = config.replace(moe=dataclasses.replace(config.moe, num_experts=12, num_groups=4, group_topk=2))
    with torch.device("meta"):
        model = DeepSeek(config)
    with pytest.raises(PlanError, match=r"4 groups of 3, which do not map onto ep=3 ranks.*Fix: ep dividing 4"):
        dtmega.check_plan(model, mesh_shape(ep=3), dtmega.Plan([ExpertParallel(), DataParallel("fsdp")]))
    layout = dtmega.check_plan(model, mesh_shape(ep=2), dtmega.Plan([ExpertParallel(dispatcher="flex"),
                                                                     DataParallel("fsdp")]))
    assert layout["layers.1.feed_forward.experts"].kernel == "moe.dispatch.flex"


def test_the_planner_costs_deepseek_v3_with_latent_attention_and_finds_a_plan_in_80_gb(capsys):
    """Issue 35's command as written (the global batch defaults to one sequence per GPU): the
    best plan fits an 80 GB H100, and the cost model counts MLA's parameters exactly."""
    import json

    from dtmega.cli import main
    from dtmega.cost.plan_cli import model_shape_for

    shape = model_shape_for("deepseek-v3")  # trained with its MTP module: 671.0 B + 11.6 B
    assert shape.total_params() == DeepSeekConfig.from_name("deepseek-v3").num_params(with_mtp=True) == 682_636_472_320
    assert shape.q_dim == shape.kv_dim == 128 * (192 + 128) // 2  # q + output and k + v widths, as GQA's formulas
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "1024", "--gpus-per-node", "8", "--gpu", "h100",
                 "--seq-length", "4096", "--top", "1", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["memory_gib"] < 80 * 1e9 / 2**30 * 0.9 and best["ep"] > 1, best


def test_multi_token_prediction_loss_is_the_shifted_cross_entropy_of_its_module():
    """The MTP depth's loss rebuilt by hand from the model's pieces: [enorm(embedding of the token
    one ahead); hnorm(last hidden)] -> eh_proj -> block -> norm -> the shared output layer,
    cross entropy against the label one further ahead, averaged over the loss mask rolled by one,
    times mtp_loss_scaling_factor; attached to the logits (its gradient reaches the MTP module)
    and absent when not training."""
    import torch.nn.functional as F

    from dtmega.models.deepseek.model import roll_left
    from dtmega.testing import reference_loss

    config = DeepSeekConfig.from_name("deepseek-debug", mtp_loss_scaling_factor=0.3)
    config = config.replace(moe=dataclasses.replace(config.moe, load_balancing="none", aux_loss_coeff=0.0))
    model = DeepSeek(config)
    model.init_weights(seed=2)
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 256, (2, 24), generator=generator)
    labels = torch.randint(0, 256, (2, 24), generator=generator)
    mask = (torch.rand(2, 24, generator=generator) > 0.3).float()
    with torch.no_grad():
        h, rope, _ = model.trunk(tokens)
        mtp = model.mtp[0]
        x = mtp.eh_proj(torch.cat([mtp.enorm(model.tok_embeddings(roll_left(tokens, 1))), mtp.hnorm(h)], dim=-1))
        logits = model.output(mtp.norm(mtp.block(x, rope)))
        ce = F.cross_entropy(logits.flatten(0, 1), roll_left(labels, 1).flatten(), reduction="none").view(2, 24)
        kept = roll_left(mask, 1)
        expected = 0.3 * (ce * kept).sum() / kept.sum()
    batch = {"tokens": tokens, "labels": labels, "loss_mask": mask}
    without = DeepSeek(config.replace(mtp_num_layers=0))
    without.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    total = reference_loss(model, batch)
    assert relative_error(total - reference_loss(without, batch), expected) <= 1e-5
    total.backward()
    assert model.mtp[0].eh_proj.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens, labels=labels, loss_mask=mask), without.eval()(tokens))


def test_megatrons_mtp_and_group_flags_reach_the_models_configs():
    """--model deepseek-* takes --mtp-num-layers/--mtp-loss-scaling-factor and the group flags;
    a Llama MoE from Megatron's size flags takes the group flags; bad values are one line."""
    from dtmega.train.args import ArgumentError, parse_train_args
    from dtmega.train.prepare import model_of

    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--seq-length", "32",
            "--train-iters", "2", "--lr", "1e-3"]
    args, _ = parse_train_args([*base, "--model", "deepseek-debug", "--mtp-num-layers", "2",
                                "--mtp-loss-scaling-factor", "0.2", "--moe-router-num-groups", "2",
                                "--moe-router-group-topk", "1"])
    _, config = model_of(args, 256)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (2, 0.2)
    assert (config.moe.num_groups, config.moe.group_topk) == (2, 1)
    from tests.train_helpers import LLAMA_BLOCK

    llama = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", *LLAMA_BLOCK,
             "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-num-groups", "4"]
    args, _ = parse_train_args([*base, *llama, "--moe-router-group-topk", "2"])
    assert model_of(args, 256)[1].moe.group_topk == 2
    args, _ = parse_train_args([*base, *llama, "--moe-router-group-topk", "5"])
    with pytest.raises(ArgumentError, match="group_topk=5 must be between 1 and num_groups=4"):
        model_of(args, 256)


def test_plans_that_do_not_divide_deepseek_are_refused_and_mtp_sits_on_the_last_stage():
    """Heads that TP cannot split whole: one PlanError naming them before any collective (a
    fake world: check_plan). Under PP the MTP module is placed with the output layer on the
    last stage, and a pipeline of 4 stages hosts it as well as one of 2."""
    import dtmega
    from dtmega.passes import DataParallel, PipelineSplit, PlanError, SequenceParallel, TensorParallel
    from tests.helpers import mesh_shape

    config = DeepSeekConfig.from_name("deepseek-debug", mtp_num_layers=1)
    with torch.device("meta"):
        model = DeepSeek(config)
    with pytest.raises(PlanError, match=rf"n_heads={config.n_heads} .*not divisible by .*3.*each rank must hold whole "
                                        "attention heads"):
        dtmega.check_plan(model, mesh_shape(tp=3), dtmega.Plan([TensorParallel(), SequenceParallel()]))
    for pp in (2, 4):
        with torch.device("meta"):
            model = DeepSeek(config.replace(n_layers=4))
        layout = dtmega.check_plan(model, mesh_shape(pp=pp), dtmega.Plan([PipelineSplit(microbatches=pp),
                                                                         DataParallel("ddp")]))
        assert layout["tok_embeddings"].stage == 0
        assert layout["mtp.0.block.attention"].stage == layout["output"].stage == pp - 1
