"""Hugging Face checkpoints under sharded plans on 4 ranks: SmolLM2-135M read slice by slice
under TP3 + SP, PP2 and FSDP2 gives transformers' logits; a Llama-3.1 under TP2 + SP and a
Mixtral under EP2 (tiny, made by transformers); and `dtmega train --load-hf` fine-tunes SmolLM2
under FSDP4 from the model's own loss.

SmolLM2 has 9 attention heads and 3 key/value heads: tensor parallelism keeps whole heads on
each rank (as Megatron does), so its TP sizes are 1, 3 and 9, not 2. TP3 runs on ranks 0-2
(rank 3 waits); TP2 + SP is shown on the tiny Llama-3.1 (4 heads, 2 KV heads).

Tolerances: logits within 1e-4 relative (max |difference| / max |logit|, fp32; reduction order
differs between the implementations and between plans, ~1e-6 measured); the first training
step's loss within 1e-3 (absolute, nats) of transformers' on the same global batch.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dtmega
from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.models.llama import Llama
from dtmega.passes import DataParallel, ExpertParallel, PipelineSplit, Plan, SequenceParallel, TensorParallel
from tests.helpers import first_ranks_mesh, full, mesh
from tests.smollm2 import smollm2_dir, transformers_model

LOGITS_RTOL = 1e-4
PROMPT = "The capital of France is Paris, and the capital of Italy"  # 12 tokens: SP splits it by 2, 3 and 4


def relative_max(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def anonymous_rss() -> int:
    """This process's anonymous resident memory (bytes): heap and tensors, not the safetensors
    files' mapped pages (page cache, shared)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakMemory:
    """Samples anonymous RSS every 5 ms while the block runs; `.peak` is the highest seen."""

    def __enter__(self) -> PeakMemory:
        self.peak, self._running = anonymous_rss(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, anonymous_rss())
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, anonymous_rss())


@pytest.fixture(scope="module")
def smollm2():
    """(directory, checkpoint, prompt ids, transformers' logits on them): rank 0 builds the
    cached directory first if it is missing and computes the reference, which it broadcasts."""
    if dist.get_rank() == 0:
        smollm2_dir()
    dist.barrier()
    directory = smollm2_dir()
    checkpoint = HFCheckpoint.open(directory)
    ids = torch.tensor([checkpoint.tokenizer.encode(PROMPT)])
    assert ids.shape[1] == 12
    reference = torch.empty(1, 12, checkpoint.config.vocab_size)
    if dist.get_rank() == 0:
        with torch.no_grad():
            reference = transformers_model(directory)(ids).logits.contiguous()
    dist.broadcast(reference, src=0)
    return directory, checkpoint, ids, reference


PLANS = {
    "tp3_sp": (dict(tp=3), [TensorParallel(), SequenceParallel()]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "pp2": (dict(pp=2), [PipelineSplit(schedule="gpipe", microbatches=1)]),
}


def _pipelined_logits(pm, ids: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Stage 0 embeds and runs its blocks, sends the hidden states to stage 1, which returns the
    logits (None on stage 0's ranks)."""
    pp_mesh = pm.mesh["pp"]
    group, stage = pp_mesh.get_group(), pp_mesh.get_local_rank()
    first = dist.get_global_rank(group, 0)
    (part,) = pm.parts
    with torch.no_grad():
        hidden = part(ids) if stage == 0 else torch.empty(ids.shape[0], ids.shape[1], dim)
        dist.broadcast(hidden, src=first, group=group)
        return part(hidden) if stage == 1 else None


@pytest.mark.parametrize("name", list(PLANS))
def test_smollm2_under_a_sharded_plan_gives_transformers_logits(name, smollm2):
    """Each rank reads only its slices (DCP resharding from the safetensors), keeps less than the
    whole model's size in anonymous memory while loading, and computes transformers' logits."""
    _, checkpoint, ids, reference = smollm2
    sizes, passes = PLANS[name]
    plan_mesh = first_ranks_mesh(**sizes) if name == "tp3_sp" else mesh(**sizes)
    if plan_mesh is None:  # rank 3 under TP3
        return
    # Pipeline stages cannot share a tied matrix: the output layer starts as a copy (exact for
    # inference; `dtmega train --load-hf ... --untie-embeddings-and-output-weights` does the same)
    config = checkpoint.config.replace(tie_embeddings=False) if name == "pp2" else checkpoint.config
    with torch.device("meta"):
        model = Llama(config)
    pm = dtmega.parallelize(model, plan_mesh, Plan(passes))
    whole = 4 * checkpoint.config.num_params()  # bytes of the whole (tied) model in fp32
    before = anonymous_rss()
    with PeakMemory() as memory:
        pm.materialize()
        checkpoint.load_into(pm.module, config)
    grown = memory.peak - before
    assert grown < whole, f"{name}: loading took {grown / 2**20:.0f} MiB, the whole model is {whole / 2**20:.0f} MiB"
    pm.eval()
    if name == "pp2":
        logits = _pipelined_logits(pm, ids, checkpoint.config.dim)
    else:
        with torch.no_grad():
            logits = full(pm.forward(ids))
        pm.reshard()
    if logits is not None:
        assert relative_max(logits, reference) < LOGITS_RTOL


def _tiny_under_plan(directory: Path, save, plan_mesh, passes: list, ids: torch.Tensor):
    """(the parallel model, its logits, transformers' logits) of a tiny transformers-made model
    that rank 0 saves to `directory` (once per session), loaded under the plan."""
    from transformers import AutoModelForCausalLM

    if dist.get_rank() == 0 and not directory.exists():
        save(directory)
    dist.barrier()
    checkpoint = HFCheckpoint.open(directory)
    with torch.device("meta"):
        model = Llama(checkpoint.config)
    pm = dtmega.parallelize(model, plan_mesh, Plan(passes))
    pm.materialize()
    checkpoint.load_into(pm.module)
    pm.eval()
    with torch.no_grad():
        ours = full(pm.forward(ids))
        theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(ids).logits
    return pm, ours, theirs


def test_llama31_under_tp2_sequence_parallel_gives_transformers_logits(shared_dir):
    """Llama-3.1 RoPE scaling, GQA (4 heads / 2 KV heads) and an untied output under TP2 + SP."""
    from tests.hf_models import save_tiny_llama31

    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(4))
    _, ours, theirs = _tiny_under_plan(shared_dir / "llama31_hf", save_tiny_llama31, mesh(tp=2),
                                       [TensorParallel(), SequenceParallel()], ids)
    assert relative_max(ours, theirs) < LOGITS_RTOL


def test_mixtral_under_expert_parallelism_gives_transformers_logits(shared_dir):
    """A tiny transformers Mixtral (4 experts, top-2) loaded under EP2 (each rank reads its two
    experts): logits equal transformers'; saved from EP2 and exported, transformers computes the
    same logits from the export."""
    from tests.hf_models import save_tiny_mixtral

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(dist.get_rank()))
    pm, ours, theirs = _tiny_under_plan(shared_dir / "mixtral_hf", save_tiny_mixtral, mesh(ep=2),
                                        [ExpertParallel(), DataParallel("ddp")], ids)
    experts = dict(pm.named_parameters())["layers.0.feed_forward.experts.w1"]
    assert experts.to_local().shape[0] == 2  # each EP rank holds half the experts
    assert relative_max(ours, theirs) < LOGITS_RTOL
    # and out again: the EP-sharded model saved (each rank its experts), exported to Hugging Face
    from transformers import AutoModelForCausalLM

    from dtmega.interop.hf_export import export_hf
    from dtmega.interop.hf_import import hf_state
    from dtmega.train.checkpoint import save_checkpoint

    checkpoint = HFCheckpoint.open(shared_dir / "mixtral_hf")
    saved = save_checkpoint(shared_dir / "mixtral_ep2", 0, pm.module, None, hf_state(checkpoint),
                            tokenizer_json=checkpoint.tokenizer.to_json())
    if dist.get_rank() == 0:
        export_hf(saved, shared_dir / "mixtral_ep2_hf")
    dist.barrier()
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(shared_dir / "mixtral_ep2_hf", dtype=torch.float32).eval()
        assert relative_max(exported(ids).logits, theirs) < LOGITS_RTOL


@pytest.fixture(scope="module")
def smollm2_corpus(shared_dir, smollm2) -> str:
    """The demo corpus (the King James Bible of `make train`), its first 400 verses, tokenized
    with SmolLM2's tokenizer: the fine-tuning data."""
    prefix = shared_dir / "smollm2_data" / "kjv"
    if dist.get_rank() == 0 and not Path(f"{prefix}_text_document.idx").exists():
        import importlib.util

        from dtmega.data.preprocess import PreprocessConfig, preprocess
        from dtmega.data.tokenizers import TokenizerSpec

        source = Path(importlib.util.find_spec("bible").submodule_search_locations[0]) / "data" / "kjv.jsonl"
        lines = source.read_text().splitlines()[:400]
        subset = shared_dir / "kjv_subset.jsonl"
        subset.write_text("\n".join(lines) + "\n")
        preprocess(PreprocessConfig(input=subset, output_prefix=str(prefix), json_keys=["text"],
                                    tokenizer=TokenizerSpec("HuggingFaceTokenizer", str(smollm2[0])), append_eod=True,
                                    progress=False))
    dist.barrier()
    return f"{prefix}_text_document"


def test_fine_tuning_smollm2_with_load_hf_starts_at_its_loss_and_lowers_it(smollm2, smollm2_corpus, shared_dir,
                                                                           monkeypatch):
    """`dtmega train --load-hf` under FSDP4 (fresh optimizer, step 0): the first step's loss
    is transformers' loss on that global batch; after 2 steps, the model `--save-hf` wrote (read
    by transformers) has a lower loss on that batch."""
    from dtmega.train.trainer import Trainer
    from tests.train_helpers import train_reusing_meshes

    directory = smollm2[0]
    first_batches = []
    step = Trainer.step

    def recording(self, batch):
        if not first_batches:
            first_batches.append(batch.clone())
        return step(self, batch)

    monkeypatch.setattr(Trainer, "step", recording)
    argv = ["--load-hf", str(directory), "--data-path", smollm2_corpus, "--split", "100,0,0", "--seq-length", "32",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4",
            "--min-lr", "1e-4", "--lr-warmup-iters", "0", "--weight-decay", "0", "--clip-grad", "1.0",
            "--use-distributed-optimizer", "--eval-iters", "0", "--eval-interval", "2",
            "--log-interval", "1", "--seed", "3", "--save", str(shared_dir / "smol_ft"),
            "--save-hf", str(shared_dir / "smol_ft_hf")]
    result = train_reusing_meshes(argv)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {key: value for key, value in first_batches[0].items()})
    batches = {tuple(b["tokens"].flatten().tolist()): b for b in everyone}
    assert len(batches) == 4  # four data-parallel ranks, a sequence each
    def loss_of(model) -> float:
        total, count = 0.0, 0.0
        with torch.no_grad():
            for batch in batches.values():
                logits = model(batch["tokens"]).logits
                losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                           reduction="none")
                mask = batch["loss_mask"].flatten().float()
                total += float((losses * mask).sum())
                count += float(mask.sum())
        return total / count

    if dist.get_rank() == 0:  # the references on one rank: four copies of transformers would share two cores
        before = loss_of(transformers_model(directory))
        assert abs(result.losses[0] - before) < 1e-3, (result.losses[0], before)
        after = loss_of(transformers_model(shared_dir / "smol_ft_hf"))
        assert after < before - 0.05, (before, after, result.losses)
        assert_exported_with_the_source_tokenizer(directory, shared_dir / "smol_ft_hf")
        print(f"\nfine-tuning: loss on the first batch {before:.4f} (transformers) vs step 1 {result.losses[0]:.4f}; "
              f"after 2 steps {after:.4f}")


def assert_exported_with_the_source_tokenizer(source: Path, exported: Path) -> None:
    """A fine-tune's export carries its source's token ids, generation settings, tokenizer and
    chat template (they were lost on the training path: eos 0 where training used 2)."""
    source_config, exported_config = (json.loads((d / "config.json").read_text()) for d in (source, exported))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert exported_config.get(key) == source_config.get(key), (key, exported_config.get(key), source_config.get(key))
    for name in ("generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        assert json.loads((exported / name).read_text()) == json.loads((source / name).read_text()), name
    assert (exported / "chat_template.jinja").read_text() == (source / "chat_template.jinja").read_text()
