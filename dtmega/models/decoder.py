"""What dtmega's decoders share (models/llama, models/deepseek): the forward over blocks with
RoPE positions, packed documents and a KV cache, the initialization scheme and the buffers.

A subclass builds `tok_embeddings`, `layers` (a ModuleDict of blocks called as
`block(h, rope, cache=..., documents=...)`), `norm` and `output`, and says how its RoPE table
is made (`_rope_cache`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dtmega.init import InitSpec, init_parameters
from dtmega.kernels.document_attention import document_mask, positions_from_documents
from dtmega.kernels.errors import DtmegaError
from dtmega.models.kv_cache import KVCache


class Decoder(nn.Module):
    """A decoder-only language model over `layers`. Build it under `torch.device("meta")`,
    shard it, then `init_weights()`."""

    # How attention masks packed documents (kernels/document_attention.py): "sdpa" (a dense mask,
    # the default) or "flex"; the DocumentMasking pass sets it on every pipeline stage.
    document_backend = "sdpa"

    def _rope_cache(self, device=None) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None, last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, S, vocab] for token ids [B, S]. position_ids [B, S] default to 0..S-1 (after
        the cached positions when decoding with a `cache`). `document_ids` [B, S] (packed
        documents: equal ids = one document) make attention causal within each document only,
        and positions restart per document unless `position_ids` say otherwise. `last_only`:
        logits [B, 1, vocab] of the last position only (a prefill that needs no prompt logits:
        S x vocab logits would be computed to be thrown away).

        A pipeline stage is this model with some pieces set to None: without an embedding it
        takes hidden states [B, S, D]; without norm and output it returns hidden states.
        """
        h, _, _ = self.trunk(tokens, position_ids, cache, document_ids)
        return self.head(h[:, -1:] if last_only else h)

    def trunk(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
              document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(the last block's hidden states, the RoPE angles used, the documents' mask): the
        forward up to the final norm."""
        seq = tokens.shape[1]
        documents, position_ids = self.packed_documents(position_ids, cache, document_ids)
        start = cache.length if cache is not None else 0
        if position_ids is None and start + seq > self.rope_cache.shape[0]:
            raise DtmegaError(
                f"{start + seq} positions, but the model's RoPE table has {self.rope_cache.shape[0]} "
                f"(the config's max_seq_len). Fix: a shorter sequence, or a model config with max_seq_len >= {start + seq}"
            )
        if position_ids is None:
            rope = self.rope_cache[start:start + seq].unsqueeze(0)
        else:
            rope = self.rope_cache[position_ids]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for name, block in self.layers.items():
            if documents is not None:
                h = block(h, rope, documents=documents)
            else:
                h = block(h, rope) if cache is None else block(h, rope, cache=cache.layer(name))
        if cache is not None:
            cache.advance(seq)
        return h, rope, documents

    def packed_documents(self, position_ids: torch.Tensor | None, cache: KVCache | None,
                         document_ids: torch.Tensor | None) -> tuple[object, torch.Tensor | None]:
        """(the documents' attention mask, the position ids: restarting per document unless given)
        for packed documents; (None, position_ids) without them. Refused with a KV cache."""
        if document_ids is None:
            return None, position_ids
        if cache is not None:
            raise DtmegaError("document_ids with a KV cache: generation decodes one sequence per row. Fix: drop "
                              "document_ids when generating")
        documents = document_mask(document_ids, self.document_backend)
        return documents, positions_from_documents(document_ids) if position_ids is None else position_ids

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the output layer (where this pipeline stage has them)."""
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_spec(self, name: str, param: nn.Parameter) -> InitSpec:
        """Megatron's scheme: N(0, std) everywhere, output projections of each block scaled by
        1/sqrt(2 * n_layers), norms at one."""
        std = self.config.init_std
        if name == "output.weight" and self.config.tie_embeddings:  # a pipeline stage's copy of the tied embedding
            return InitSpec("normal", std, key="tok_embeddings.weight")
        if param.ndim == 1:
            return InitSpec("ones")
        if name.endswith(("attention.wo.weight", "w2.weight", "experts.w2")):
            return InitSpec("trunc_normal", std / math.sqrt(2 * self.config.n_layers))
        if name == "tok_embeddings.weight":
            return InitSpec("normal", std)
        return InitSpec("trunc_normal", std)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initializes parameters in place (sharded or not: same values) and rebuilds buffers."""
        self._tie()
        init_parameters(self, self.init_spec, seed=seed)
        self.init_buffers(buffer_device or self.rope_cache.device)

    def _tie(self) -> None:
        if self.config.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # to_empty() unties shared parameters

    def init_buffers(self, device: torch.device) -> None:
        """Re-ties a tied output layer and rebuilds the buffers (RoPE table, MoE counters) on
        `device`, leaving the parameters' values as they are: for weights loaded next."""
        self._tie()
        if device.type == "meta":
            return
        self.rope_cache = self._rope_cache(device)
        for module in self.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers(device)
