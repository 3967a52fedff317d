"""A tiny training configuration over a synthetic byte-level corpus."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from dtmega.data.preprocess import PreprocessConfig, preprocess
from dtmega.data.tokenizers import TokenizerSpec
from tests.corpus import make_texts, write_jsonl


def prepare_corpus(root: Path, documents: int = 400) -> str:
    """Byte-tokenized corpus prefix (made once by rank 0; every rank gets the prefix)."""
    prefix = root / "data" / "corpus"
    if not dist.is_initialized() or dist.get_rank() == 0:
        if not Path(f"{prefix}_text_document.idx").exists():
            source = write_jsonl(root / "corpus.jsonl", make_texts(documents, seed=3))
            preprocess(PreprocessConfig(input=source, output_prefix=str(prefix), tokenizer=TokenizerSpec("byte"),
                                        append_eod=True, progress=False))
    if dist.is_initialized():
        dist.barrier()
    return f"{prefix}_text_document"


# Megatron's flags for a Llama block (its defaults are GPT blocks': LayerNorm, learned positions,
# biases, GeLU, dropout 0.1), as Megatron-LM's Llama scripts pass them
LLAMA_BLOCK = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
               "--attention-dropout", "0", "--hidden-dropout", "0"]


def tiny_args(data: str, **overrides) -> list[str]:
    """`dtmega train` flags of a 2-block model that trains in seconds; overrides are flag=value."""
    options = {
        "num-layers": 2, "hidden-size": 64, "ffn-hidden-size": 128, "num-attention-heads": 8,
        "num-query-groups": 4, "seq-length": 32, "micro-batch-size": 2, "global-batch-size": 8,
        "train-iters": 20, "lr": 3e-3, "min-lr": 3e-4, "lr-decay-style": "cosine", "lr-warmup-iters": 4,
        "weight-decay": 0.1, "clip-grad": 1.0, "data-path": data, "split": "90,10,0",
        "tokenizer-type": "byte", "eval-interval": 10, "eval-iters": 2, "log-interval": 5, "seed": 11,
    }
    options.update({k.replace("_", "-"): v for k, v in overrides.items()})
    if "load" in overrides and not {"override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"} & set(overrides):
        # these tests resume with other lengths (and so other schedules) than they saved: they follow their
        # own flags, as Megatron does with --override-opt_param-scheduler (test_load_flags.py tests the check)
        options["override-opt-param-scheduler"] = True
    if "lr_warmup_iters" not in overrides:  # short runs need warmup < decay
        options["lr-warmup-iters"] = min(4, int(options["train-iters"]) // 2)
    argv = ["--group-query-attention", *LLAMA_BLOCK]
    for key, value in options.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not None and value is not False:  # 0 is a value (`0 in (None, False)` is True)
            argv += [f"--{key}", str(value)]
    return argv


def train_reusing_meshes(argv: list[str]):
    """`dtmega train` on the suite's cached mesh of the sizes `argv` asks for (a new mesh per
    run would add process groups, and gloo threads, that slow every later test)."""
    from dtmega.train.args import parse_train_args
    from dtmega.train.setup import run_shape
    from dtmega.train.trainer import train
    from tests.helpers import mesh

    return train(argv, mesh=mesh(**run_shape(parse_train_args(argv)[0], dist.get_world_size()).mesh_sizes()))


def train_tiny_checkpoint(root: Path, train_iters: int = 20, context: int = 128) -> Path:
    """A trained byte-level checkpoint of the tiny model with a `context`-token RoPE table (one
    rank, in this process): for the commands that load one (serve, evaluate, generate)."""
    from dtmega.train.trainer import train

    data = prepare_corpus(root, documents=200)
    save = root / "checkpoints"
    train(tiny_args(data, train_iters=train_iters, save=str(save), save_interval=train_iters, eval_iters=0,
                    eval_interval=train_iters, max_position_embeddings=context))
    return save
