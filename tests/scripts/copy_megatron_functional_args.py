"""Copy `MODEL_ARGS` of Megatron-LM's functional-test configurations for GPT, MoE and Mixtral
(`tests/functional_tests/test_cases/{gpt,moe,mixtral}/*/model_config.yaml`) out of a Megatron-LM
git checkout into `tests/data/megatron_functional_model_args.json`, with the commit they came from.

The suite holds dtmega's `--dry-run` share over this copy (tests/unit/test_megatron_functional_configs.py,
issue 51 item 5); rerun this script to refresh it against a newer Megatron-LM:

    python tests/scripts/copy_megatron_functional_args.py /path/to/Megatron-LM[.git]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

FAMILIES = ("gpt", "moe", "mixtral")
OUT = Path(__file__).resolve().parents[1] / "data" / "megatron_functional_model_args.json"


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir" if repo.endswith(".git") or Path(repo, "HEAD").exists() else "-C", repo,
                           *args], check=True, capture_output=True, text=True).stdout


def copy_model_args(repo: str) -> dict:
    """Read every family's `model_config.yaml` at the checkout's HEAD and return
    {"commit", "configs": {"<family>/<case>": MODEL_ARGS}} with values as YAML parsed them."""
    commit = _git(repo, "rev-parse", "HEAD").strip()
    names = _git(repo, "ls-tree", "-r", "--name-only", "HEAD", "tests/functional_tests/test_cases").split()
    configs = {}
    for name in sorted(names):
        parts = name.split("/")
        if len(parts) != 6 or parts[3] not in FAMILIES or parts[5] != "model_config.yaml":
            continue
        document = yaml.safe_load(_git(repo, "show", f"HEAD:{name}")) or {}
        # BASE_MODEL_ARGS (one configuration has them) come first; MODEL_ARGS override them
        configs[f"{parts[3]}/{parts[4]}"] = {**(document.get("BASE_MODEL_ARGS") or {}), **(document.get("MODEL_ARGS") or {})}
    return {"source": "https://github.com/NVIDIA/Megatron-LM", "commit": commit, "configs": configs}


if __name__ == "__main__":
    copied = copy_model_args(sys.argv[1])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(copied, indent=1, sort_keys=True) + "\n")
    print(f"{len(copied['configs'])} configurations from {copied['commit']} -> {OUT}")
