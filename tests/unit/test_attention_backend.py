"""The attention kernel as a plan decision (issue 36): each candidate this machine runs computes
the unfused math's causal attention (forward and every gradient, GQA and MLA's head dims;
fp32, 1e-5 relative: the same sums in another order); the measured choice, driven by a fake
timer, picks the fastest, breaks near-ties by a fixed preference (so ranks agree), drops a
candidate that cannot run, keeps its answer on disk and reads it back instead of measuring,
survives a damaged file; the choice lands in the layout (the core's kernel) and the plan's
notes with every candidate's time; Megatron's names map onto the kernels; a forced kernel the
device lacks is refused before anything is built."""

from __future__ import annotations

import json

import pytest
import torch

import dtmega
from dtmega.kernels.attention_backends import BACKENDS, MEGATRON_BACKENDS, available, causal_attention
from dtmega.kernels.measured_choice import MeasuredChoice
from dtmega.models import Llama
from dtmega.models.deepseek import DeepSeek, DeepSeekConfig
from dtmega.passes import AttentionBackend, PassManager, Plan, PlanError, Program, Recompute, Workload
from tests.helpers import debug_llama, mesh_shape


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


CASES = [(b, dims) for b in BACKENDS if available(b, "cpu") for dims in ((4, 2, 16, 16), (4, 4, 24, 12))
         if not (b == "flash" and dims[2] != dims[3])]  # FlashAttention needs v's head dim = q/k's


@pytest.mark.parametrize("backend, dims", CASES, ids=[f"{b}-{'gqa' if d[1] != d[0] else 'mla_dims'}" for b, d in CASES])
def test_each_cpu_candidate_equals_the_unfused_math(backend, dims):
    heads, kv_heads, qk, v = dims
    generator = torch.Generator().manual_seed(heads + qk)
    q = torch.randn(2, 40, heads, qk, generator=generator, requires_grad=True)
    k = torch.randn(2, 40, kv_heads, qk, generator=generator, requires_grad=True)
    value = torch.randn(2, 40, kv_heads, v, generator=generator, requires_grad=True)
    grad = torch.randn(2, 40, heads, v, generator=generator)
    results = {}
    for name in (backend, "math"):
        out = causal_attention(name, q, k, value)
        results[name] = (out, *torch.autograd.grad(out, (q, k, value), grad))
    for ours, reference in zip(results[backend], results["math"]):
        assert relative_error(ours, reference) < 1e-5


def fake_timer(times: dict[str, float], calls: list[str]):
    def timer(candidate: str) -> float:
        calls.append(candidate)
        if times[candidate] is None:
            raise RuntimeError(f"{candidate} cannot run this")
        return times[candidate]
    return timer


def test_the_measured_choice_takes_the_fastest_and_remembers_it(tmp_path):
    path = tmp_path / "choices.json"
    calls: list[str] = []
    chooser = MeasuredChoice("attention", path, preference=("flash", "cudnn", "efficient", "flex", "math"))
    times = {"flash": 3e-3, "cudnn": 1e-3, "efficient": None, "flex": 2e-3, "math": 9e-3}
    choice = chooser.choose("shape A", list(times), fake_timer(times, calls))
    assert choice.chosen == "cudnn" and not choice.cached and calls == list(times)
    assert choice.seconds["efficient"] is None and "efficient: cannot run" in choice.describe()
    # read back, by this chooser or another process's: no measurement
    again = MeasuredChoice("attention", path).choose("shape A", list(times), fake_timer(times, calls))
    assert again.chosen == "cudnn" and again.cached and len(calls) == len(times)
    assert json.loads(path.read_text())["attention"]["shape A"]["chosen"] == "cudnn"
    # another shape is measured on its own; near-ties (within 3 %) go to the preferred kernel
    tied = {"flash": 1.02e-3, "cudnn": 1e-3, "efficient": 5e-3, "flex": 5e-3, "math": 5e-3}
    assert chooser.choose("shape B", list(tied), fake_timer(tied, calls)).chosen == "flash"
    assert chooser.cached("shape A").chosen == "cudnn"  # the first answer kept beside the second


def test_a_damaged_choices_file_is_measured_over_and_nothing_runs_is_an_error(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    calls: list[str] = []
    chooser = MeasuredChoice("attention", path)
    assert chooser.choose("s", ["math", "flash"], fake_timer({"math": 2.0, "flash": 1.0}, calls)).chosen == "flash"
    assert json.loads(path.read_text())["attention"]["s"]["chosen"] == "flash"
    with pytest.raises(ValueError, match="none of .* could run t"):
        chooser.choose("t", ["math"], fake_timer({"math": None}, calls))


def annotated(model, plan, sizes: dict, workload: Workload | None = Workload(seq_len=256, micro_batch=2)) -> Program:
    program = Program.build(model, mesh_shape(**sizes), workload)
    PassManager(Plan(plan).passes).annotate(program)
    return program


def test_auto_writes_the_measured_choice_into_the_layout_and_the_notes(tmp_path):
    """The fake timer's fastest kernel for this rank's shapes (TP2: 4 of 8 heads, 2 of 4 KV
    heads) becomes every core's kernel; the note lists every candidate's time; cores that
    selective recompute gave its own op keep it."""
    times = {"flash": 2e-3, "cudnn": 1e-3, "efficient": 1.5e-3, "flex": 4e-3, "math": 8e-3}
    calls: list[str] = []
    with torch.device("meta"):
        model = Llama(debug_llama(n_heads=8, n_kv_heads=4))
    program = annotated(model, [dtmega.passes.TensorParallel(),
                                AttentionBackend("auto", timer=fake_timer(times, calls), cache=str(tmp_path / "c.json"))],
                        dict(tp=2))
    cores = [f"layers.{name}.attention.core" for name in model.layers]
    assert {program.layout[fqn].kernel for fqn in cores} == {"attention.sdpa.cudnn"}
    note = next(line for line in program.log if line.startswith("AttentionBackend(auto)"))
    assert "causal B2 S256 H4/2 D8/8 float32" in note and "cudnn (1.00 ms; flash 2.00, efficient 1.50" in note
    with torch.device("meta"):
        model = Llama(debug_llama(n_heads=8, n_kv_heads=4))
    program = annotated(model, [Recompute("selective"), AttentionBackend("flash")], {})
    assert {program.layout[fqn].kernel for fqn in cores} == {"attention.recomputed"}
    assert any("keep the kernel another pass chose (attention.recomputed)" in line for line in program.log)


def test_flash_is_refused_for_latent_attention_whose_value_heads_are_narrower():
    """MLA's value heads (v_head_dim) differ from its query/key heads: FlashAttention cannot run
    them (torch finds no kernel), so forcing it is a PlanError naming the fix; `auto` measures
    flash as unable to run and picks among the others."""
    with torch.device("meta"):
        model = DeepSeek(DeepSeekConfig.from_name("deepseek-debug"))
    with pytest.raises(PlanError, match=r"FlashAttention needs the value heads as wide as the query/key heads; this "
                                        r"model.s are 8 and 16 wide. Fix: --attention-backend fused, unfused or auto"):
        annotated(model, [AttentionBackend("flash")], {})


def test_auto_with_nothing_to_measure_leaves_the_choice_to_torch():
    with torch.device("meta"):
        model = DeepSeek(DeepSeekConfig.from_name("deepseek-debug"))
    program = annotated(model, [AttentionBackend("auto")], {}, workload=None)
    assert program.layout["layers.0.attention.core"].kernel is None
    assert any("torch's scaled_dot_product_attention picks the kernel (no workload gives the shapes)" in line
               for line in program.log)


def test_megatrons_names_map_onto_the_kernels_and_a_missing_kernel_is_refused(one_rank_mesh):
    assert MEGATRON_BACKENDS == {"flash": "flash", "fused": "cudnn", "unfused": "math", "local": "math", "auto": "auto"}
    with torch.device("meta"):
        model = Llama(debug_llama())
    program = annotated(model, [AttentionBackend("fused")], {})  # annotation only: the device is not known
    assert program.layout["layers.0.attention.core"].kernel == "attention.sdpa.cudnn"
    with pytest.raises(PlanError, match=r"the cudnn kernel runs on cuda, not cpu. Fix: --attention-backend auto, or "
                                        r"one of flash, math"):
        dtmega.parallelize(model, dtmega.make_mesh(dp_shard=1), Plan([AttentionBackend("fused")]))
    with pytest.raises(PlanError, match=r"AttentionBackend\('triton'\) is unknown"):
        annotated(model, [AttentionBackend("triton")], {})


def test_the_train_flag_adds_the_pass(capsys):
    from dtmega.cli import main
    from tests.train_helpers import LLAMA_BLOCK

    gpt = ["train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--micro-batch-size", "1",
           "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3"]
    assert main([*gpt, *LLAMA_BLOCK, "--attention-backend", "unfused", "--dry-run", "1"]) == 0
    assert "AttentionBackend" in capsys.readouterr().out
    # GPT blocks drop attention probabilities (Megatron's default 0.1): unfused (plain math) drops
    # them as Megatron's unfused attention does; a kernel that would not is refused
    assert main([*gpt, "--attention-backend", "unfused", "--dry-run", "1"]) == 0
    assert "AttentionBackend" in capsys.readouterr().out
    assert main([*gpt, "--attention-backend", "flash", "--dry-run", "1"]) == 2
    assert "drop attention probabilities in training (p=0.1)" in capsys.readouterr().err


def test_unfused_attention_keeps_the_gpt_cores_dropout():
    """AttentionBackend('unfused') on GPT blocks with dropout: loss and every gradient equal the
    model without the pass (the same plan-independent masks), in float64 where the two paths
    differ only by summation order (1e-10). Evaluation runs the math kernel and equals too."""
    from dtmega.models.gpt.config import GPT_SIZES
    from dtmega.models.gpt.model import GPT

    def model():
        m = GPT(GPT_SIZES["gpt-debug"].replace(attention_dropout=0.2, hidden_dropout=0.2)).double()
        m.init_weights(seed=3)
        return m

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    plain = model()
    pm = dtmega.parallelize(model(), dtmega.make_mesh(dp_shard=1), Plan([AttentionBackend("unfused")]))
    assert type(pm.module.layers["0"].attention.core).__name__ == "BackendCore"
    losses = []
    for m in (plain, pm.module):
        m.train()
        loss = m(tokens, sample_ids=torch.arange(2)).square().mean()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-10, atol=0)
    grads = dict(plain.named_parameters())
    for name, p in pm.module.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-13, msg=name)
    for m in (plain, pm.module):
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm.module(tokens), plain(tokens), rtol=1e-10, atol=1e-12)
