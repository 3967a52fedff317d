"""Running the evaluation tasks on a parallel model: the work split over data-parallel ranks,
tensor-parallel ranks computing together, one progress bar, sums gathered to every rank.

WikiText's windows go through `ParallelModel.loss_sum`, the training step's own loss (vocab-
parallel cross entropy under TP, never the full logits), one global batch of `micro_batch` x
data-parallel windows at a time (a rank past the last window adds an all-masked row, so every
rank takes part in every collective). LAMBADA needs the argmax, so its passages go through the
forward and only the target positions' logits are gathered whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtmega
from dtmega.kernels.errors import DtmegaError
from dtmega.progress import progress_bar
from dtmega.tasks import lambada, wikitext


def evaluate_wikitext(pm: dtmega.ParallelModel, tokenizer, path: str, *, seq_length: int, overlapping_eval: int,
                      micro_batch: int = 4) -> wikitext.WikitextResult:
    """Loss, perplexity and adjusted perplexity of a WikiText-style file (wikitext.py)."""
    raw = wikitext.read_text(path)
    words = wikitext.count_words(raw)
    tokens = torch.tensor(tokenizer.encode(wikitext.detokenize(raw)), dtype=torch.long)
    if len(tokens) < 2:
        raise DtmegaError(f"--valid-data {path} has {len(tokens)} token(s); perplexity needs at least 2")
    if int(tokens.max()) >= pm.program.facts.vocab_size:
        raise DtmegaError(f"the tokenizer gives id {int(tokens.max())}, beyond the model's vocabulary")
    todo = wikitext.windows(len(tokens), seq_length, overlapping_eval)
    dp, rank = pm.dp_size, pm.dp_rank
    per_batch = micro_batch * dp
    batches = -(-len(todo) // per_batch)
    device = pm.mesh.device_type
    total = 0.0
    pm.eval()
    with progress_bar("evaluate wikitext", total=batches, unit="batches") as bar:
        for b in range(batches):
            mine = todo[b * per_batch + rank * micro_batch: b * per_batch + (rank + 1) * micro_batch]
            rows = [wikitext.window_batch(tokens, w, seq_length, tokenizer.eod) for w in mine]
            rows += [wikitext.window_batch(tokens, None, seq_length, tokenizer.eod)] * (micro_batch - len(rows))
            inputs, labels, mask = (torch.stack(column) for column in zip(*rows))
            loss_sum, _ = pm.loss_sum(dtmega.make_batch(inputs, labels, mask).to(device))
            total += float(loss_sum)
            bar.advance()
    return wikitext.summarize(total, len(tokens), words, len(todo))


@torch.no_grad()
def evaluate_lambada(pm: dtmega.ParallelModel, tokenizer, path: str, *, strict: bool, context: int,
                     micro_batch: int = 4) -> lambada.LambadaResult:
    """Last-word accuracy on a LAMBADA JSONL file (lambada.py)."""
    examples = lambada.read_examples(path, tokenizer, strict, context)
    dp, rank = pm.dp_size, pm.dp_rank
    mine = examples[rank::dp]
    device = pm.mesh.device_type
    correct = 0
    pm.eval()
    batches = -(-len(examples) // (micro_batch * dp))
    with progress_bar("evaluate lambada", total=batches, unit="batches") as bar:
        for b in range(batches):
            group = mine[b * micro_batch:(b + 1) * micro_batch]
            if group:
                correct += _count_correct(pm, group, tokenizer.eod, tokenizer.vocab_size, device)
            bar.advance()
    counted = torch.tensor([correct], dtype=torch.long, device=device)
    if dp > 1:  # the tensor-parallel ranks of a data-parallel group counted the same passages
        dist.all_reduce(counted, group=pm.program.flat_submesh(pm.program.data_axes(context=False)).get_group())
    return lambada.LambadaResult(int(counted.item()), len(examples), strict)


def _count_correct(pm: dtmega.ParallelModel, group: list[lambada.Example], pad: int, vocab: int, device: str) -> int:
    sequences = [e.context + e.targets[:-1] for e in group]
    longest = max(len(s) for s in sequences)
    tokens = torch.full((len(group), longest), pad, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        tokens[i, :len(sequence)] = torch.tensor(sequence)
    logits = pm.forward(tokens.to(device))
    correct = 0
    for i, example in enumerate(group):
        first = len(example.context) - 1  # the position that predicts the first target
        rows = logits[i, first:first + len(example.targets)]
        if isinstance(rows, DTensor):
            rows = rows.full_tensor()
        predicted = rows[:, :vocab].argmax(-1).tolist()  # padded vocabulary rows are never real tokens
        correct += int(predicted == example.targets)
    return correct
