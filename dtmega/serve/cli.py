"""`dtmega serve`: a checkpoint behind Megatron's text generation API and OpenAI's completions.

    dtmega serve --load runs/demo/checkpoints --port 5000
    curl 'http://localhost:5000/api' -X PUT -H 'Content-Type: application/json; charset=UTF-8' \
         -d '{"prompts":["And God said"], "tokens_to_generate":16}'
    torchrun --nproc-per-node 2 -m dtmega serve --load ckpt --tensor-model-parallel-size 2

Rank 0 answers HTTP (uvicorn in a thread); every rank runs the engine in its main thread
(engine.py). SIGTERM or Ctrl-C on rank 0 stops accepting connections, finishes the requests in
flight, then ends every rank.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading

import torch
import torch.distributed as dist
import uvicorn

from dtmega.kernels.errors import DtmegaError
from dtmega.mesh import broadcast_object, default_device_type, init_distributed
from dtmega.models.kv_cache import decoding_families
from dtmega.printing import console
from dtmega.serve.app import ServedModel, ServeLimits, build_app
from dtmega.serve.chat_source import choose_chat_template
from dtmega.serve.engine import Engine
from dtmega.serve.kv_budget import (
    KVCacheSize,
    check_fits_memory,
    describe_kv_cache,
    kv_budget,
    kv_bytes_per_token,
    size_kv_cache,
    weight_bytes,
)
from dtmega.serve.shutdown import CallsInFlight, stop_when_answered
from dtmega.train.restore import (
    add_model_source,
    read_source_head,
    restore_with_progress,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmega serve", description="Serve a checkpoint over HTTP (Megatron's PUT /api, "
                                "OpenAI's POST /v1/completions and /v1/chat/completions, GET /v1/health).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_source(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; the server "
                                                        "has no authentication, so mind who can reach it)")
    p.add_argument("--port", type=int, default=5000, help="TCP port (0: any free port, printed at start-up)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (launch that many ranks)")
    p.add_argument("--max-batch-size", type=int, default=32,
                   help="most sequences decoded together (KV cache slots, fewer if the cache budget holds fewer; "
                        "more wait for a free slot)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="positions per sequence, prompt and generated tokens together (default: the model's context)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache bytes per rank, e.g. 4GiB (default: 90%% of a GPU less the weights; on the CPU 4 GiB, "
                        "at most half the available memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the device's memory the server may take, weights included (vLLM's flag; on the "
                        "CPU: of the host memory available at start)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body accepted")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may take before it is cancelled (HTTP 504)")
    p.add_argument("--model-name", nargs="+", default=None,
                   help="the names a request's `model` may give (vLLM's --served-model-name): the first is the name in "
                        "responses; another name is answered 404 model_not_found (default: the checkpoint's directory "
                        "name, and the --load or --load-hf path as given)")
    p.add_argument("--chat-template", default=None,
                   help="the chat template of /v1/chat/completions: a Hugging Face tokenizer directory (its "
                        "tokenizer_config.json or chat_template.jinja) or a .jinja file (default: the checkpoint's own: "
                        "the tokenizer files a fine-tune of a Hugging Face model keeps, or --load-hf's)")
    p.add_argument("--custom-import", nargs="+", default=[], help="modules that register the checkpoint's model")
    return p


def served_names(given: list[str] | None, directory: str, path: str | None) -> tuple[str, ...]:
    """The names the server answers to: `--model-name`'s (the first in responses), else the
    checkpoint's directory name and the path the model was loaded from, as given (vLLM's default
    name), each once."""
    names = list(given) if given else [directory, *([str(path).rstrip("/")] if path else [])]
    return tuple(dict.fromkeys(name for name in names if name))


def check_arguments(a: argparse.Namespace) -> None:
    """Every setting checked before the checkpoint is read or a rank joins."""
    if not 0 <= a.port <= 65535:
        raise DtmegaError(f"--port {a.port} is not a TCP port. Fix: a number from 1 to 65535 (0: any free port)")
    for flag, value in (("--max-batch-size", a.max_batch_size), ("--max-request-bytes", a.max_request_bytes),
                        ("--tensor-model-parallel-size", a.tensor_model_parallel_size)):
        if value < 1:
            raise DtmegaError(f"{flag} {value} must be at least 1")
    if not a.request_timeout > 0:
        raise DtmegaError(f"--request-timeout {a.request_timeout} must be a positive number of seconds")
    if a.max_model_len is not None and a.max_model_len < 2:
        raise DtmegaError(f"--max-model-len {a.max_model_len} must be at least 2 (a prompt token and a generated one)")


def cache_size(a: argparse.Namespace, config, device_type: str) -> KVCacheSize:
    """The KV cache's slots and length for the model `config` (kv_budget.py); ValueError naming
    the fix when the budget cannot hold one sequence. Pure arithmetic: nothing is allocated."""
    context = int(config.max_seq_len)
    max_len = a.max_model_len or context
    if max_len > context:
        raise DtmegaError(f"--max-model-len {max_len} is longer than the model's context ({context} positions). "
                         f"Fix: --max-model-len {context} or less")
    dtype = torch.get_default_dtype()  # the dtype the served weights, and so the cache, take
    tp = a.tensor_model_parallel_size
    budget = kv_budget(kv_cache_memory=a.kv_cache_memory, utilization=a.gpu_memory_utilization,
                       device_type=device_type, weights=weight_bytes(config, tp, dtype))
    size = size_kv_cache(budget=budget, max_len=max_len, bytes_per_token=kv_bytes_per_token(config, tp, dtype),
                         max_batch_size=a.max_batch_size)
    check_fits_memory(size, device_type, weight_bytes(config, tp, dtype), budget.source)
    return size


def bind(host: str, port: int) -> socket.socket | str:
    """A listening socket, or why there is none (said on every rank by the caller)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.set_inheritable(True)
        return sock
    except OSError as error:
        return (f"cannot listen on {host}:{port} ({error.strerror or error}). Fix: another --port (0 picks a free "
                "one), or stop the process that holds it")


def connection_limit() -> int:
    """Connections served at once: the process's descriptor limit less a margin for its own files,
    so clients past it get 503 at once instead of the server running out of descriptors (matrix
    3, H20: 1,010 unfinished bodies left a 1,024-descriptor server unable to answer health)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 65536) - 64)


def main(argv: list[str]) -> None:
    """Loads the checkpoint, listens, and serves until SIGTERM/Ctrl-C."""
    a = build_parser().parse_args(argv)
    check_arguments(a)
    head = read_source_head(a, contents=False)
    chat = choose_chat_template(a.chat_template, head)  # read and parsed before any rank joins or weight is read
    if head.spec.family not in decoding_families():
        raise DtmegaError(f"dtmega serve decodes {', '.join(decoding_families())} models (their KV cache); this "
                         f"checkpoint holds a {head.spec.family} model. Fix: evaluate it with dtmega evaluate")
    size = cache_size(a, head.config, default_device_type())  # before any rank joins or any weight is read
    init_distributed()
    if dist.get_world_size() != a.tensor_model_parallel_size:
        raise DtmegaError(f"{dist.get_world_size()} ranks were launched for --tensor-model-parallel-size "
                         f"{a.tensor_model_parallel_size}; the server runs one model replica. Fix: torchrun "
                         f"--nproc-per-node {a.tensor_model_parallel_size}, or --tensor-model-parallel-size "
                         f"{dist.get_world_size()}")
    leader = dist.get_rank() == 0
    sock = bind(a.host, a.port) if leader else None  # before the weights are read: a busy port fails at once
    problem = broadcast_object(sock if isinstance(sock, str) else None)
    if problem:
        raise DtmegaError(problem)
    pm, tokenizer, _ = restore_with_progress(a.load, tp=a.tensor_model_parallel_size, custom_import=a.custom_import,
                                             load_hf=a.load_hf, tokenizer_model=a.tokenizer_model, positions=size.max_len)
    pm.eval()
    context = size.max_len
    engine = Engine(pm.module, vocab_size=tokenizer.vocab_size, slots=size.slots, max_len=context,
                    decode_text=tokenizer.decode, device=pm.mesh.device_type, leader=leader)
    engine.reserve()
    if not leader:
        for signum in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop, after draining
            signal.signal(signum, signal.SIG_IGN)
        engine.run()
        return
    run_dir = head.checkpoint.parent if head.checkpoint.name.startswith("iter_") else head.checkpoint
    names = served_names(a.model_name, run_dir.name, a.load or a.load_hf)
    stopping = threading.Event()
    app = build_app(engine, ServedModel(names[0], tokenizer, context, tokenizer.vocab_size, chat.template, names[1:]),
                    ServeLimits(a.max_request_bytes, a.request_timeout), stopping)
    calls = CallsInFlight(app)
    server = uvicorn.Server(uvicorn.Config(calls, log_level="warning", timeout_graceful_shutdown=a.request_timeout,
                                           limit_concurrency=connection_limit()))
    host, port = sock.getsockname()[:2]

    failures: list[BaseException] = []

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as error:  # noqa: BLE001 - reported by the main thread, after every rank stopped
            failures.append(error)
        finally:
            engine.stop()  # after the last request in flight: the engine finishes and every rank ends

    def drain(signum, frame) -> None:
        console().print(f"[dim]{signal.Signals(signum).name}: finishing the requests in flight, then stopping[/dim]")
        stopping.set()  # bodies still awaited are answered 503 at once, not waited for
        server.should_exit = True
        stop_when_answered(server, calls, a.request_timeout)  # not on clients that stopped reading (H18)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, drain)
    thread = threading.Thread(target=serve_http, name="dtmega-http", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    chat_endpoint = f", POST {url}/v1/chat/completions" if chat.template else ""
    console().print(size.describe() + (f" (--max-batch-size {a.max_batch_size}: the budget holds {size.slots})"
                                       if size.slots < a.max_batch_size else ""), highlight=False)
    console().print(f"[dim]{describe_kv_cache(head.config, a.tensor_model_parallel_size, torch.get_default_dtype())}"
                    "[/dim]", highlight=False)
    console().print(chat.note, highlight=False, soft_wrap=True, markup=False)
    console().print(f"serving {' = '.join(names)} ({context}-token context, {size.slots} sequences at a time) on {url}: "
                    f"PUT {url}/api, POST {url}/v1/completions{chat_endpoint}, GET {url}/v1/health", highlight=False,
                    soft_wrap=True)  # one line at any width: scripts (and ServerProcess) read the address from it
    try:
        engine.run()
    except BaseException:
        # the engine broke (a peer rank went away): its sequences were answered 503; let the HTTP
        # thread send those answers and stop, then say why in one line
        stopping.set()
        server.should_exit = True
        thread.join(timeout=10)
        raise
    thread.join()
    if failures:
        raise RuntimeError(f"the HTTP server failed: {failures[0]!r}") from failures[0]
    if not server.started:
        raise RuntimeError("the HTTP server stopped before it started (uvicorn's log above says why)")
    console().print(f"stopped: {engine.generated} tokens generated in {engine.forwards} forwards", highlight=False)
