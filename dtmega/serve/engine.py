"""The decoding engine behind `dtmega serve`: continuous batching over a slot KV cache.

Every rank runs `Engine.run()`, the same forwards on the same inputs (tensor-parallel ranks hold
their own heads). Rank 0 alone takes requests (`submit`, `cancel`, `stop`, thread-safe, called
by the HTTP server's thread) and, before every step, broadcasts what changes: the sequences that
join (with their slot, prompt and sampling settings) and those that leave. A step then

1. prefills the joining sequences (one forward per prompt length) and chooses their first token;
2. decodes every running sequence by one token in one batched forward (rows at their own
   lengths: `SlotKVCache`);
3. ends sequences at their stop token, their token budget or a stop string, freeing the slot.

The choice of a token depends only on the logits and the sequence's own generator (seeded from
the request), so a request's tokens do not depend on what it was batched with, and all ranks
agree without exchanging tokens. When idle, rank 0 still broadcasts an empty step every second
so waiting ranks never reach the collective timeout.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtmega.joining import DistributedTimeout
from dtmega.mesh import broadcast_object
from dtmega.models.slot_cache import SlotKVCache
from dtmega.train.sampling import choose_next
from dtmega.train.watch import looks_like_a_lost_peer

IDLE_HEARTBEAT_S = 1.0
PREFILL_TOKENS = 8192  # prompt tokens one prefill forward takes (more rows of one length: more forwards)
UNAVAILABLE = "server unavailable"  # how a result's error starts when the server itself broke (HTTP 503)


class _LostPeer(Exception):
    """A collective broke because a peer rank went away: the engine, not a sequence, failed."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class Sampling:
    """How one sequence chooses its tokens. temperature 0 (or top_k 1) is greedy; top_k 0 and
    top_p 1 filter nothing. `stop_strings` end the sequence once its generated text contains one;
    `top_logprobs` > 0 also reports that many most likely tokens at every position."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()  # more tokens that end the sequence (a chat's end-of-turn)
    prompt_logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class SequenceRequest:
    """One prompt to continue (a request with several prompts is several of these)."""

    id: int
    prompt_ids: list[int]
    sampling: Sampling


@dataclass
class SequenceResult:
    """What a sequence produced. `logprobs[i]` is log p(ids[i]) under the model's raw logits;
    `prompt_logprobs[i]` that of prompt token i + 1 (when asked for). `finish_reason`: "stop"
    (stop token or string), "length" (the token budget), "cancelled" or "error" (`error` says)."""

    id: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str = ""
    error: str = ""


@dataclass
class _Running:
    request: SequenceRequest
    slot: int
    generator: torch.Generator | None  # made when the sequence joins
    result: SequenceResult
    next_token: int | None = None  # chosen, not yet fed to the model


@dataclass
class _Step:
    """What rank 0 broadcasts before a step."""

    start: list[tuple[int, SequenceRequest]] = field(default_factory=list)  # (slot, request)
    cancel: list[int] = field(default_factory=list)
    stop: bool = False


class Engine:
    """Continuous batching of `slots` sequences of up to `max_len` positions (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, slots: int, max_len: int,
                 decode_text: Callable[[list[int]], str], device: torch.device | str = "cpu", leader: bool = True):
        self.model, self.vocab_size, self.decode_text = model, vocab_size, decode_text
        self.device, self.leader = torch.device(device), leader
        self.cache = SlotKVCache(slots, max_len, device=self.device)
        # a prefill computes the last position's logits only (matrix 3, H22: [B, S, V] logits of a
        # 4,000-token prompt on a 50,000-word vocabulary were 24.8 GB); a model of its own without
        # the argument gets its logits sliced
        self._last_only = "last_only" in inspect.signature(model.forward).parameters
        self.running: dict[int, _Running] = {}
        # rank 0's side: requests waiting for a slot, cancellations, callbacks (guarded by _lock)
        self._lock = threading.Condition()
        self._waiting: deque[tuple[SequenceRequest, Callable[[SequenceResult], None]]] = deque()
        self._cancelled: set[int] = set()
        self._callbacks: dict[int, Callable[[SequenceResult], None]] = {}
        self._token_callbacks: dict[int, Callable[[int, int], None]] = {}  # streaming: (sequence id, token)
        self._free_slots = list(range(slots))
        self._stopping = False
        self.steps = 0  # broadcast rounds, idle heartbeats included
        self.forwards = 0  # model forwards (prefills and batched decodes)
        self.generated = 0  # tokens chosen
        self.last_step = time.monotonic()  # when the last step (or idle heartbeat) ended: health's liveness
        self.broken: str | None = None  # why the engine stopped for good (a peer rank went away)

    @torch.no_grad()
    def reserve(self) -> None:
        """Allocates the whole KV cache now, one token through slot 0 on every rank alike, so a
        cache the device cannot hold fails at start rather than at the first request."""
        self.cache.select([0], 1)
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), position_ids=self.cache.positions(1),
                   cache=self.cache)
        self.cache.free(0)

    def cache_bytes(self) -> int:
        """Bytes the KV cache holds on this rank (keys and values of every block)."""
        return sum(t.numel() * t.element_size() for layer in self.cache.layers.values()
                   for t in (layer.keys, layer.values) if t is not None)

    # ---- rank 0, any thread -----------------------------------------------------------------

    def submit(self, request: SequenceRequest, on_done: Callable[[SequenceResult], None],
               on_token: Callable[[int, int], None] | None = None) -> None:
        """Queues a sequence; `on_done(result)` is called from the engine's thread when it ends,
        and `on_token(sequence id, token)` (streaming) for each token it generates, before that."""
        with self._lock:
            if on_token is not None:
                self._token_callbacks[request.id] = on_token
            self._waiting.append((request, on_done))
            self._lock.notify()

    def cancel(self, ids: list[int]) -> None:
        """Ends these sequences at the next step (a client that left, a request past its timeout)."""
        with self._lock:
            self._cancelled.update(ids)
            self._lock.notify()

    def stop(self) -> None:
        """Finishes what was submitted, then ends `run()` on every rank."""
        with self._lock:
            self._stopping = True
            self._lock.notify()

    def load(self) -> dict[str, int]:
        """Sequences decoding and waiting, slots, and the forwards and tokens so far (the health
        endpoint: tokens per forward is the batching achieved)."""
        with self._lock:
            return {"running": len(self.running), "waiting": len(self._waiting), "slots": self.cache.slots,
                    "max_model_len": self.cache.max_len, "kv_cache_bytes": self.cache_bytes(),
                    "forwards": self.forwards, "generated_tokens": self.generated,
                    "free_slots": len(self._free_slots),
                    "seconds_since_step": round(time.monotonic() - self.last_step, 3)}

    # ---- every rank ------------------------------------------------------------------------

    @torch.no_grad()
    def run(self) -> None:
        """Steps until rank 0 says stop (after its `stop()` and the last sequence). A peer rank
        that goes away (tensor parallelism) ends every sequence, running or waiting, with an
        "unavailable" error and raises a one-line DistributedTimeout (matrix 3, H24: a raw gloo
        traceback, and 500s naming gloo for the requests in flight)."""
        while True:
            try:
                step = broadcast_object(self._plan_step() if self.leader else None)
                if step.stop:
                    return
                self._apply(step)
            except _LostPeer as lost:
                raise self._broken(lost.error) from None
            except Exception as error:
                if looks_like_a_lost_peer(error):
                    raise self._broken(error) from None
                raise

    def _broken(self, error: BaseException) -> DistributedTimeout:
        """Every sequence ended as unavailable (the answers go out before the server stops)."""
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        self.broken = (f"a rank of this server went away (killed, out of memory, a node failure); the server stops. "
                       f"The backend said: {first}")
        for running in list(self.running.values()):
            running.result.error = f"{UNAVAILABLE}: {self.broken}"
            self._finish(running, "error")
        if self.leader:
            with self._lock:
                waiting, self._waiting = list(self._waiting), deque()
            for request, on_done in waiting:
                on_done(SequenceResult(request.id, request.prompt_ids, finish_reason="error",
                                       error=f"{UNAVAILABLE}: {self.broken}"))
        return DistributedTimeout(f"rank {dist.get_rank() if dist.is_initialized() else 0}: {self.broken}. Fix: look "
                                  "at that rank's logs, then start the server again")

    def _plan_step(self) -> _Step:
        """Rank 0: cancellations and the waiting sequences that get a slot; waits (up to the
        heartbeat) while there is nothing to do."""
        with self._lock:
            if not self.running and not self._waiting and not self._cancelled and not self._stopping:
                self._lock.wait(IDLE_HEARTBEAT_S)
            step = _Step(cancel=sorted(self._cancelled & set(self.running)))
            for request, on_done in [(r, f) for r, f in self._waiting if r.id in self._cancelled]:
                self._waiting.remove((request, on_done))
                self._token_callbacks.pop(request.id, None)
                on_done(SequenceResult(request.id, request.prompt_ids, finish_reason="cancelled"))
            self._cancelled.clear()
            while self._waiting and self._free_slots:
                request, on_done = self._waiting.popleft()
                self._callbacks[request.id] = on_done
                step.start.append((self._free_slots.pop(0), request))
            step.stop = self._stopping and not self.running and not step.start and not self._waiting
            return step

    def _apply(self, step: _Step) -> None:
        for sequence_id in step.cancel:
            self._finish(self.running[sequence_id], "cancelled")
        decoding = [r for r in self.running.values() if r.next_token is not None]
        joining = []
        for slot, request in step.start:
            running = _Running(request, slot, None, SequenceResult(request.id, request.prompt_ids))
            self.running[request.id] = running
            self.cache.free(slot)
            if self._isolated([running], lambda running=running: self._join(running)):
                joining.append(running)
        self._prefill(joining)
        self._isolated(decoding, lambda: self._decode(decoding))
        self.steps += 1
        self.last_step = time.monotonic()

    def _isolated(self, rows: list[_Running], work: Callable[[], None]) -> bool:
        """Runs `work` for `rows`; if it raises, those rows (and only they) end with the error and
        their slots are freed (matrix 3, H1/H22: one sequence's bad seed or a prefill's failed
        allocation used to end every running request and leak the slot). True if it ran."""
        try:
            work()
            return True
        except Exception as error:  # noqa: BLE001 - a failure ends the sequences it concerns, not the server
            if looks_like_a_lost_peer(error):  # not this sequence's fault: the server cannot go on
                raise _LostPeer(error) from None
            for running in rows:
                if running.request.id in self.running:
                    running.result.error = f"{type(error).__name__}: {error}"
                    self._finish(running, "error")
            return False

    def _join(self, running: _Running) -> None:
        """The sequence's own generator (torch takes seeds below 2^64; a larger one is reduced)."""
        running.generator = torch.Generator(device=self.device).manual_seed(running.request.sampling.seed % (1 << 64))

    def _forward(self, rows: list[_Running], tokens: torch.Tensor, all_positions: bool) -> torch.Tensor:
        """Logits [B, S or 1, V] in fp32 for `tokens` [B, S] continuing each row's slot."""
        self.cache.select([r.slot for r in rows], tokens.shape[1])
        self.forwards += 1
        extra = {"last_only": True} if not all_positions and self._last_only else {}
        logits = self.model(tokens, position_ids=self.cache.positions(tokens.shape[1]), cache=self.cache, **extra)
        if not all_positions:
            logits = logits[:, -1:]
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logits = logits.float()
        logits[..., self.vocab_size:] = float("-inf")  # padded vocabulary rows are never real tokens
        return logits

    def _prefill(self, joining: list[_Running]) -> None:
        by_length: dict[int, list[_Running]] = {}
        for running in joining:
            by_length.setdefault(len(running.request.prompt_ids), []).append(running)
        for length, rows in by_length.items():
            per_forward = max(1, PREFILL_TOKENS // length)  # a token budget per prefill forward (vLLM's
            for start in range(0, len(rows), per_forward):  # max_num_batched_tokens): n 32 x 4,000 is 16 forwards
                group = rows[start:start + per_forward]
                self._isolated(group, lambda group=group: self._prefill_group(group))

    def _prefill_group(self, rows: list[_Running]) -> None:
        """One forward over prompts of one length, then each row's first token."""
        tokens = torch.tensor([r.request.prompt_ids for r in rows], device=self.device)
        wants_prompt = any(r.request.sampling.prompt_logprobs for r in rows)
        logits = self._forward(rows, tokens, all_positions=wants_prompt)
        for i, running in enumerate(rows):
            sampling = running.request.sampling
            if sampling.prompt_logprobs:
                log_probs = logits[i, :-1].log_softmax(-1)
                targets = tokens[i, 1:, None]
                running.result.prompt_logprobs = log_probs.gather(-1, targets).squeeze(-1).tolist()
                if sampling.top_logprobs:
                    running.result.prompt_top_logprobs = [_top(row, sampling.top_logprobs) for row in log_probs]
            if sampling.max_new_tokens == 0:
                self._finish(running, "length")
                continue
            self._isolated([running], lambda i=i, running=running: self._choose(running, logits[i, -1]))

    def _decode(self, rows: list[_Running]) -> None:
        rows = [r for r in rows if r.request.id in self.running]
        if not rows:
            return
        tokens = torch.tensor([[r.next_token] for r in rows], device=self.device)
        logits = self._forward(rows, tokens, all_positions=False)
        for i, running in enumerate(rows):
            self._isolated([running], lambda i=i, running=running: self._choose(running, logits[i, -1]))

    def _choose(self, running: _Running, logits: torch.Tensor) -> None:
        """Chooses the next token from last-position logits [V]; ends the sequence if it stops."""
        sampling, result = running.request.sampling, running.result
        greedy = sampling.temperature <= 0 or sampling.top_k == 1
        choice = choose_next(logits[None], temperature=0.0 if greedy else sampling.temperature,
                             top_k=sampling.top_k, top_p=sampling.top_p, generator=running.generator)
        token = int(choice.ids)
        if token == sampling.stop_token or token in sampling.stop_tokens:
            self._finish(running, "stop")
            return
        log_probs = logits.log_softmax(-1)
        result.ids.append(token)
        self.generated += 1
        on_token = self._token_callbacks.get(result.id) if self.leader else None
        if on_token is not None:
            on_token(result.id, token)
        result.logprobs.append(float(log_probs[token]))
        if sampling.top_logprobs:
            result.top_logprobs.append(_top(log_probs, sampling.top_logprobs))
        running.next_token = token
        if sampling.stop_strings and any(s in self.decode_text(result.ids) for s in sampling.stop_strings):
            self._finish(running, "stop")
        elif len(result.ids) >= sampling.max_new_tokens:
            self._finish(running, "length")

    def _finish(self, running: _Running, reason: str) -> None:
        running.result.finish_reason = reason
        del self.running[running.request.id]
        self.cache.free(running.slot)
        if self.leader:
            with self._lock:
                self._free_slots.append(running.slot)
                on_done = self._callbacks.pop(running.request.id, None)
                self._token_callbacks.pop(running.request.id, None)
            if on_done is not None:
                on_done(running.result)


def _top(log_probs: torch.Tensor, n: int) -> dict[int, float]:
    """The n most likely token ids of one position and their log-probabilities."""
    values, ids = torch.topk(log_probs, n)
    return dict(zip(ids.tolist(), values.tolist()))


def wait_all(engine: Engine, requests: list[SequenceRequest], timeout: float | None = None) -> list[SequenceResult]:
    """Submits `requests` and blocks until all end (for scripts and tests that run `engine.run()`
    in another thread); on timeout the rest are cancelled and reported as such."""
    done = threading.Event()
    results: dict[int, SequenceResult] = {}

    def collect(result: SequenceResult) -> None:
        results[result.id] = result
        if len(results) == len(requests):
            done.set()

    for request in requests:
        engine.submit(request, collect)
    deadline = None if timeout is None else time.monotonic() + timeout
    if not done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
        engine.cancel([r.id for r in requests if r.id not in results])
        done.wait()
    return [results[r.id] for r in requests]
