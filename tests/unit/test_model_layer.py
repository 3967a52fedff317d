"""The model layer cannot silently mis-train (issue 50): passes swap the modules in a model's slots
and never run a copy of model code, every parameter where activations are sharded is accounted
for, and a kernel never replaces a module whose parameters or computation it does not know.

- A researcher's Llama subclass with per-head q/k RMSNorm (tests/qk_norm_models.py) under
  FuseKernels runs its own forward: its logits equal the unsharded model's (on main at 30c0e1e
  they differed by 0.23: the fused attention was a copy of Llama's without the norms).
- The same norms under another name than dtmega's rules know are refused by tensor
  parallelism, naming them and the fix (TP2+SP numerics with the known names:
  tests/distributed/test_qk_norm.py).
- FuseKernels refuses a norm of a class it does not compute, or with a parameter more.
- No pass or model assigns `.forward` but the named wrappers (docs/architecture.md), and no code
  outside a family's folder branches on a family's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import dtmega
from dtmega.models import LlamaConfig
from dtmega.models.slots import RMSNorm
from dtmega.passes import FuseKernels, Plan, PlanError, SequenceParallel, TensorParallel
from dtmega.testing import relative_error
from tests.qk_norm_models import OtherNames, perturb_norms, qk_llama

ROOT = Path(__file__).resolve().parents[2]


def _config() -> LlamaConfig:
    return LlamaConfig.from_name("debug")


def test_a_qk_norm_subclass_runs_its_own_forward_under_fuse_kernels(one_rank_mesh):
    with torch.device("meta"):
        model = qk_llama(_config())
    reference = qk_llama(_config())
    reference.init_weights(seed=3)
    perturb_norms(reference, seed=4)
    pm = dtmega.parallelize(model, dtmega.make_mesh(dp_shard=1), Plan([FuseKernels(impl="reference")]))
    pm.materialize()
    pm.module.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = reference(tokens), pm(tokens)
    assert relative_error(got, expected) < 1e-5
    # what FuseKernels did swap: the slot modules the subclass's forward does not call, and the norms around it
    kernels = {fqn: entry.kernel for fqn, entry in pm.layout.modules.items() if entry.kernel}
    assert kernels["layers.0.attention_norm"] == "rms_norm.reference" and "layers.0.attention" not in kernels


def test_norms_no_rule_knows_are_refused_by_name_under_tensor_parallelism():
    with torch.device("meta"):
        known, other = qk_llama(_config()), qk_llama(_config(), OtherNames)
    plan = Plan([TensorParallel(), SequenceParallel()])
    layout = dtmega.check_plan(known, {"tp": 2}, plan)
    assert layout["layers.0.attention.q_norm"].style == "head_norm"
    with pytest.raises(PlanError, match=r"layers\.0\.attention\.q_layernorm\.weight.*Rule\('layers\.0\.attention\."
                                        r"q_layernorm', 'head_norm'\)"):
        dtmega.check_plan(other, {"tp": 2}, plan)


class NormWithBias(RMSNorm):
    """dtmega's RMSNorm slot, extended by a researcher with a bias."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return super().forward(x) + self.bias


def test_fuse_kernels_refuses_a_norm_it_does_not_know():
    with torch.device("meta"):
        model = dtmega.models.Llama(_config())
        model.layers["1"].attention_norm = NormWithBias(64)
    with pytest.raises(PlanError, match=r"FuseKernels would replace layers\.1\.attention_norm by the rms_norm kernel.*"
                                        r"Fix: FuseKernels\(rms_norm=False\)"):
        dtmega.check_plan(model, {"dp_shard": 1}, Plan([FuseKernels()]))
    dtmega.check_plan(model, {"dp_shard": 1}, Plan([FuseKernels(rms_norm=False)]))


# Where a pass or a model still sets a module's forward: wrappers that run the module's own
# forward inside a context or hand its input through, each named in docs/architecture.md.
FORWARD_WRAPPERS = {
    "passes/data_parallel.py": "autocast",  # one-rank data parallelism's autocast around each part's forward
    "passes/float8_te.py": "fp8_forward",  # Transformer Engine's fp8_autocast around each part's forward
    "passes/hidden_out.py": "forward_or_hidden",  # the output layer hands its input to a fused loss
    "passes/float8.py": "_fp8_forward",  # a Linear's GEMM as the FP8 GEMM on the same weight and bias
}


def test_no_pass_or_model_assigns_forward_but_the_named_wrappers():
    found = {}
    for path in sorted((*ROOT.glob("passes/**/*.py"), *ROOT.glob("dtmega/models/**/*.py"))):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.forward\s*=[^=]", line):
                found.setdefault(str(path.relative_to(ROOT)), []).append(f"{number}: {line.strip()}")
    assert set(found) == set(FORWARD_WRAPPERS), found
    for path, marker in FORWARD_WRAPPERS.items():
        assert all(marker in line for line in found[path]), (path, found[path])
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert all(path in architecture for path in FORWARD_WRAPPERS)


def test_no_code_outside_a_family_folder_branches_on_a_family_name():
    """Interop, the trainer, the planner and the passes ask the family, not its name."""
    branch = re.compile(r"""(family(\.name)?|\.family)\s*(==|!=|\bin\b)\s*[("']|[("']dtmega-\w+["']\s*(==|!=)""")
    offenders = []
    for path in sorted((*ROOT.glob("dtmega/**/*.py"), *ROOT.glob("passes/**/*.py"))):
        relative = str(path.relative_to(ROOT))
        if relative.startswith(("dtmega/models/", "passes/families/")):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if branch.search(line):
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


class ScaledLinear(nn.Linear):
    """A researcher's Linear with a computation of its own (a learned output scale)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.ones(self.out_features))

    def forward(self, x):
        return super().forward(x) * self.scale


def test_float8_refuses_a_linear_whose_computation_it_would_drop():
    from dtmega.passes import Float8

    config = LlamaConfig.from_name("debug").replace(dim=256, ffn_dim=512, n_heads=4, n_kv_heads=4)
    with torch.device("meta"):
        model = dtmega.models.Llama(config)
        old = model.layers["0"].feed_forward.w1
        model.layers["0"].feed_forward.w1 = ScaledLinear(old.in_features, old.out_features, bias=False)
    plan = Plan([Float8(recipe="tensorwise", min_features=16, device="cuda")])
    with pytest.raises(PlanError, match=r"Float8 would run layers\.0\.feed_forward\.w1 as an FP8 GEMM.*has a forward "
                                        r"of its own.*Fix: a plain nn\.Linear"):
        dtmega.check_plan(model, {"dp_shard": 1}, plan)
