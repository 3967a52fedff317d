"""Installed as users install it: a wheel built from the tree, into a fresh virtual environment.

The wheel nests passes/ and kernels/ under dtmega (nothing generic lands in site-packages); the
editable install this suite otherwise runs from resolves them from the source tree, which hid a
wheel without `dtmega.cost` (every model command died on import). So one test installs the
wheel, with torch pinned as the Makefile pins it, into a new venv and runs commands from a
directory outside the source tree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import dtmega.kernels
import dtmega.passes
from tests.corpus import make_texts, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"dtmega": ROOT / "dtmega", "dtmega/passes": ROOT / "passes", "dtmega/kernels": ROOT / "kernels"}

# Imports every module of the installed package (except the CLI entry `__main__`), and says
# where dtmega was imported from, so the test can check it is the venv and not the tree.
IMPORT_EVERYTHING = """
import importlib, pkgutil, dtmega
failed = []
for info in pkgutil.walk_packages(dtmega.__path__, "dtmega."):
    if not info.name.endswith("__main__"):
        try:
            importlib.import_module(info.name)
        except Exception as error:
            failed.append(f"{info.name}: {error!r}")
print(dtmega.__file__)
print("\\n".join(failed))
"""


def torch_pin() -> str:
    """The Makefile's torch pin (the CPU build on this machine's disk)."""
    return re.search(r"^TORCH_PIN := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def source_copy(into: Path) -> Path:
    """The tree's source files (tracked, or new and not ignored) copied to `into`: setuptools
    builds in the source folder and packs whatever an earlier build left in `build/`, which once
    hid a package missing from the configuration."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    return into


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = source_copy(tmp_path_factory.mktemp("source"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (built,) = out.glob("dtmega-*.whl")
    return built


def test_editable_install_maps_the_layers_to_the_source_folders():
    assert Path(dtmega.passes.__file__).resolve() == ROOT / "passes" / "__init__.py"
    assert Path(dtmega.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_wheel_contains_every_source_module_of_the_three_layers_under_dtmega(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{prefix}/{path.relative_to(folder).as_posix()}"
                for prefix, folder in LAYERS.items() for path in folder.rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing[:5]} ({len(missing)} in all)"
    assert not [n for n in names if n.split("/")[0] in ("passes", "kernels", "tests", "examples", "benchmarks")]


def test_a_wheel_installed_in_a_fresh_venv_runs_plan_and_a_train_dry_run_outside_the_tree(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # This suite's pip installs into the new environment (`--python`): no pip bootstrap, no
    # byte-compiling of torch (both only cost time); dependencies resolve as for any user.
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile",
         "--disable-pip-version-check", torch_pin(), str(wheel)],
        capture_output=True, text=True, timeout=900,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    work = tmp_path / "outside"
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    def run(*argv: str) -> str:
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    where, *failed = run(str(python), "-c", IMPORT_EVERYTHING).strip().splitlines()
    assert Path(where).is_relative_to(env_dir), f"dtmega was imported from {where}, not the venv"
    assert not [line for line in failed if line], failed

    plan = json.loads(run("dtmega", "plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq-length",
                          "4096", "--global-batch-size", "128", "--json", "--top", "2"))
    assert len(plan) == 2 and plan[0]["memory_gib"] < 80 and plan[0]["tokens_per_s_per_gpu"] > 0, plan

    write_jsonl(work / "data.jsonl", make_texts(60))
    run("dtmega", "preprocess", "--input", "data.jsonl", "--json-keys", "text", "--output-prefix", "data/corpus",
        "--train-tokenizer", "300", "--append-eod", "--workers", "1")
    out = run("dtmega", "train", "--model", "debug", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--data-path", "data/corpus_text_document", "--tokenizer-type", "HuggingFaceTokenizer",
              "--tokenizer-model", "data/tokenizer.json", "--seq-length", "64", "--micro-batch-size", "2",
              "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3", "--dry-run", "4")
    assert "plan check out; nothing ran" in out, out[-2000:]
    # the planner as another framework runs a published configuration (issue 33)
    out = run("dtmega", "plan", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100", "--framework", "megatron-core",
              "--fp8", "--fp8-recipe", "tensorwise", "--seq-length", "8192", "--global-batch-size", "128", "--top", "1",
              "--compare", "tp=4,pp=8,vp=5,cp=1,mb=1,recompute=none,mode=distributed-optimizer,overlap=userbuffers")
    assert " fits (" in out and " rank #" in out, out[-2000:]
    # chat data and an SFT launch line checked (issue 34): the template beside the trained tokenizer
    (work / "data" / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + "
        "eos_token }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"}))
    (work / "chats.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}"}]}) + "\n" for i in range(20)))
    run("dtmega", "preprocess", "--chat", "--input", "chats.jsonl", "--output-prefix", "data/chat", "--tokenizer-type",
        "HuggingFaceTokenizer", "--tokenizer-model", "data", "--seq-length", "64")
    out = run("dtmega", "train", "--model", "debug", "--sft", "--data-path", "data/chat", "--tokenizer-type",
              "HuggingFaceTokenizer", "--tokenizer-model", "data/tokenizer.json", "--seq-length", "64",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3",
              "--split", "90,10,0", "--dry-run", "2")
    assert "plan check out; nothing ran" in out and "attention.document.varlen" in out, out[-2000:]
