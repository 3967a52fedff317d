"""A pass of one's own reaches `dtmega train` (issue 47, item 3): `--plan FILE` or `[[passes]]` in
`--config` add passes to the plan the flags build (or replace one of its passes, by name), in the
places their declarations give them; the dry run shows them, a 2-rank launch builds them, and the
dry run, the launch and the checkpoint hold the same plan. Everything a plan file can get wrong is
refused with the table and the fix. Before: `[[passes]]` in a config was "unknown option(s)
['passes']" and no flag took a plan."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtmega.passes import Pass, PlanError, Program
from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.prepare import dry_run, prepare_run
from dtmega.train.setup import build_plan, run_shape
from tests.train_helpers import prepare_corpus, tiny_args

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples" / "mlp_tp_plan.toml"
MLP_TABLE = '[[passes]]\npass = "MLPTensorParallel"\nmodule = "examples.custom_pass"\n'


@dataclass
class AfterTensorParallel(Pass):
    """Reads what tensor parallelism decided, so it declares it runs after it."""

    after = ("tensor_parallel@*",)

    def mesh_axes(self) -> tuple[str, ...]:
        return ()

    def annotate(self, program: Program) -> None:
        pass

    def apply(self, program: Program) -> None:
        pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("custom_plan"), documents=60)


def _line(corpus: str, **flags) -> list[str]:
    return tiny_args(corpus, tensor_model_parallel_size=2, sequence_parallel=True, **flags)


def _plan_names(argv: list[str], world: int = 2) -> list[str]:
    args, _ = parse_train_args(argv)
    return [p.name for p in build_plan(args, run_shape(args, world), 2)]


def test_a_plan_file_runs_its_pass_instead_of_the_flags_tensor_parallel(corpus, capsys):
    args, notes = parse_train_args([*_line(corpus, plan=str(PLAN)), "--dry-run", "2"])
    layout = dry_run(args, notes)
    printed = " ".join(capsys.readouterr().out.split())
    assert "plan: MLPTensorParallel, SequenceParallel," in printed
    assert layout["layers.0.feed_forward.w1"].params["weight"].placements == {"tp": "S(0)"}
    assert layout["layers.0.feed_forward.w2"].outputs["tp"] == "P->S(1)"  # the flags' SequenceParallel refines it
    assert layout["layers.0.attention.wq"].style is None
    assert layout["layers.0.attention.wq"].params["weight"].placements == {}


def test_passes_in_the_config_are_a_plan_file(corpus, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f"tensor_model_parallel_size = 2\nsequence_parallel = true\n\n{MLP_TABLE}"
                      'replaces = "TensorParallel"\n')
    line = [a for a in _line(corpus) if a != "--sequence-parallel"]
    line = line[:line.index("--tensor-model-parallel-size")] + line[line.index("--tensor-model-parallel-size") + 2:]
    from_config = _plan_names(["--config", str(config), *line])
    assert from_config == _plan_names(_line(corpus, plan=str(PLAN)))
    assert from_config[:2] == ["MLPTensorParallel", "SequenceParallel"]


def test_added_passes_go_where_their_declarations_put_them(corpus, tmp_path):
    """A pass that declares nothing goes first (the flags' passes that fill what nobody decided,
    fused kernels and data parallelism, then keep its decisions); one that runs after tensor
    parallelism goes right after it; the file's passes keep their order."""
    plan = tmp_path / "plan.toml"
    plan.write_text('[[passes]]\npass = "AfterTensorParallel"\nmodule = "tests.unit.test_custom_plan"\n\n'
                    '[[passes]]\npass = "TokenWeightedLoss"\nmodule = "tests.user_passes"\n')
    names = _plan_names(_line(corpus, plan=str(plan)))
    assert names[:4] == ["TensorParallel", "AfterTensorParallel", "TokenWeightedLoss", "SequenceParallel"]
    plan.write_text('[[passes]]\npass = "TokenWeightedLoss"\nmodule = "tests.user_passes"\n\n'
                    '[[passes]]\npass = "AfterTensorParallel"\nmodule = "tests.unit.test_custom_plan"\n')
    names = _plan_names(_line(corpus, plan=str(plan)))
    assert names[:4] == ["TokenWeightedLoss", "TensorParallel", "AfterTensorParallel", "SequenceParallel"]
    assert names[-1] == "DataParallel"


BAD_PLANS = {
    "unknown pass": ('[[passes]]\npass = "NoSuchPass"\n',
                     r"table 1 \(NoSuchPass\): unknown pass 'NoSuchPass'.*Fix: module = "),
    "unknown field": (f'{MLP_TABLE}replaces = "TensorParallel"\nsize = 2\n',
                      r"MLPTensorParallel has no option\(s\) \['size'\].*Fix: only MLPTensorParallel's own fields"),
    "field of another type": (f'{MLP_TABLE}replaces = "TensorParallel"\naxis = 2\n',
                              r"axis = 2 is an int, but MLPTensorParallel.axis takes a str. Fix: .* axis = \"tp\""),
    "module not importable": ('[[passes]]\npass = "MLPTensorParallel"\nmodule = "no_such_module"\n',
                              r"module = 'no_such_module': No module named 'no_such_module'. Fix: a module importable"),
    "a value the pass refuses": ('[[passes]]\npass = "DataParallel"\nreplaces = "DataParallel"\nmode = "zero"\n',
                                 r"table 1 \(DataParallel\): DataParallel\(mode='zero'\) is unknown; use one of .*Fix:"),
    "an option in a plan file": (f'lr = 0.1\n{MLP_TABLE}', r"unknown key\(s\) \['lr'\].*Fix: put options in --config"),
    "no tables": ('# nothing\n', r"no \[\[passes\]\] tables. Fix:"),
    "no pass name": ('[[passes]]\naxis = "tp"\n', r"table 1 has no pass = \"ClassName\". Fix:"),
    "what a flag-built pass does": (MLP_TABLE, r"MLPTensorParallel and TensorParallel, which the flags build, both "
                                               r"provide 'tensor_parallel@tp'.*Fix: replaces = \"TensorParallel\""),
    "a flag-built pass again": ('[[passes]]\npass = "DataParallel"\nmode = "ddp"\n',
                                r"DataParallel and DataParallel, which the flags build, both provide 'data_parallel'"),
    "replacing what the flags do not build": (f'{MLP_TABLE}replaces = "ContextParallel"\n',
                                              r"replaces = 'ContextParallel', but the flags build no ContextParallel "
                                              r"\(they build TensorParallel, SequenceParallel, .*\). Fix: drop replaces"),
    "replacing twice": (f'{MLP_TABLE}replaces = "TensorParallel"\n\n{MLP_TABLE}replaces = "TensorParallel"\n',
                        r"MLPTensorParallel and MLPTensorParallel both replace TensorParallel. Fix: keep one"),
}


@pytest.mark.parametrize("name", BAD_PLANS)
def test_a_plan_file_that_cannot_run_is_refused_naming_the_table_and_the_fix(name, corpus, tmp_path):
    text, message = BAD_PLANS[name]
    plan = tmp_path / "plan.toml"
    plan.write_text(text)
    with pytest.raises(ArgumentError, match=message) as caught:
        _plan_names(_line(corpus, plan=str(plan)))
    assert str(caught.value).startswith(f"--plan {plan}: ") and "\n" not in str(caught.value)


def test_a_missing_plan_file_and_passes_given_twice_are_refused(corpus, tmp_path):
    with pytest.raises(ArgumentError, match=r"--plan nope.toml: no such file. Fix:"):
        _plan_names(_line(corpus, plan="nope.toml"))
    config = tmp_path / "run.toml"
    config.write_text(MLP_TABLE)
    with pytest.raises(ArgumentError, match=r"run.toml: \[\[passes\]\] tables and --plan both give passes of your own. "
                                            r"Fix: keep one"):
        parse_train_args(["--config", str(config), "--plan", str(PLAN)])


def test_a_custom_decision_a_flag_built_pass_would_overwrite_is_refused_by_name(corpus, tmp_path):
    """The token-weighted loss (tests/user_passes.py) on the output layer, and --cross-entropy-loss-fusion
    asking FuseKernels for its fused loss there: before, the fused loss silently won."""
    plan = tmp_path / "plan.toml"
    plan.write_text('[[passes]]\npass = "TokenWeightedLoss"\nmodule = "tests.user_passes"\n')
    args, _ = parse_train_args(_line(corpus, plan=str(plan), cross_entropy_loss_fusion=True))
    with pytest.raises(PlanError, match=r"FuseKernels changes output.kernel from 'cross_entropy.token_weighted' .* "
                                        r"which TokenWeightedLoss decided"):
        prepare_run(args, 2)


def test_a_two_rank_launch_builds_the_plan_the_dry_run_checked_and_the_checkpoint_records(corpus, tmp_path):
    save = tmp_path / "ckpt"
    line = _line(corpus, plan=str(PLAN), train_iters=4, lr_warmup_iters=1, eval_iters=0, save=str(save),
                 save_interval=4)
    checked = prepare_run(parse_train_args([*line, "--dry-run", "2"])[0], 2).plan.to_toml()
    out = tmp_path / "built.json"
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
               "-m", "tests.scripts.custom_plan_launch", str(out), *line]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    built = json.loads(out.read_text())
    assert built["w1"] == {"style": "colwise", "placements": {"tp": "S(0)"}, "local": [64, 64]}  # ffn 128 / 2
    assert built["wq"] == {"style": None, "placements": {}, "local": [64, 64]}  # whole on each rank
    assert len(built["losses"]) == 4 and all(math.isfinite(loss) for loss in built["losses"])
    saved = json.loads((save / "iter_0000004" / "state.json").read_text())
    assert built["plan"] == checked == saved["plan"]
    assert 'pass = "MLPTensorParallel"' in checked
