"""Torch's own console messages while dtmega compiles (issue 47, item 9): inside
`TorchMessagesToFile` a torch logger's record (Dynamo's "won't convert" traceback) and a Python
warning land in the file, not on the console; afterwards torch logs to the console again; the
capture summary names the file; and `torch.compile(pm.forward_backward)` is refused with the
one-line fix (under TP torch crashed inside: tests/distributed/test_step_capture.py)."""

from __future__ import annotations

import io
import logging
import warnings

import pytest
import torch

import dtmega
from dtmega.passes import Plan, PlanError
from dtmega.step_capture import CaptureReport
from dtmega.torch_messages import TorchMessagesToFile, _console_handlers
from tests.helpers import build_dtmega_llama, debug_llama


def _console_streams(buffer: io.StringIO) -> list[tuple[logging.StreamHandler, object]]:
    """Points torch's console handlers at `buffer` (what the user's console would show): (handler,
    its stream) to put back."""
    held = [(handler, handler.stream) for _, _, handler in _console_handlers()]
    for handler, _ in held:
        handler.setStream(buffer)
    return held


def test_torch_messages_go_to_the_file_and_the_console_comes_back(tmp_path):
    console = io.StringIO()
    held = _console_streams(console)
    log = logging.getLogger("torch._dynamo.convert_frame")  # propagates to torch._dynamo's console handler
    try:
        messages = TorchMessagesToFile(tmp_path / "logs" / "capture.log")
        assert not messages.written
        for attempt in range(2):  # reusable: a step enters it on every call
            with messages:
                log.warning("WON'T CONVERT _device_step, attempt %d\nTraceback (most recent call last):", attempt)
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.warn("a torch warning stand-in", UserWarning, stacklevel=1)
        assert console.getvalue() == ""
        text = messages.path.read_text()
        assert "attempt 0" in text and "attempt 1" in text and "Traceback" in text
        assert "a torch warning stand-in" in text and messages.written
        log.warning("after the block")
        assert "after the block" in console.getvalue()
        messages.close()
    finally:
        for handler, stream in held:
            handler.setStream(stream)


def test_the_summary_names_the_file_only_when_torch_wrote():
    report = CaptureReport("aot_eager", "step", False, graphs=5)
    assert "torch's messages" not in report.describe()
    report.log_file = "/tmp/dtmega/capture_step-1-rank0.log"
    assert report.describe().splitlines()[-1].endswith("/tmp/dtmega/capture_step-1-rank0.log")


def test_the_captured_step_keeps_torchs_messages_out_of_the_console(tmp_path, capsys):
    reference, meta_copy = build_dtmega_llama(debug_llama(n_layers=1), seed=5)
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(device_type="cpu"), Plan([]))
    pm.init_weights(seed=5)
    console = io.StringIO()
    held = _console_streams(console)
    try:
        step = dtmega.capture_step(pm, torch.optim.AdamW(pm.parameters(), lr=torch.tensor(1e-3)), backend="aot_eager",
                                   log_file=tmp_path / "capture.log")
        # a message torch logs while the step compiles (on one rank Dynamo may log nothing) goes to the file
        original = step._compiled

        def logging_compiled(*args):
            logging.getLogger("torch._dynamo").warning("Graph break stand-in\nTraceback (most recent call last):")
            return original(*args)

        step._compiled = logging_compiled
        step(dtmega.synthetic_batch(2, 16, 256, seed=1))
    finally:
        for handler, stream in held:
            handler.setStream(stream)
    assert console.getvalue() == ""
    printed = capsys.readouterr().out
    assert "whole-step capture" in printed and str(tmp_path / "capture.log") in printed
    assert "Graph break stand-in" in (tmp_path / "capture.log").read_text()


@pytest.mark.parametrize("entry", ["forward_backward", "loss_sum"])
def test_compiling_the_whole_step_is_refused_with_the_fix(entry):
    _, meta_copy = build_dtmega_llama(debug_llama(n_layers=1), seed=5)
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(device_type="cpu"), Plan([]))
    pm.init_weights(seed=5)
    batch = dtmega.synthetic_batch(2, 16, 256, seed=1)
    torch._dynamo.reset()
    with pytest.raises(PlanError, match=rf"torch.compile\(pm.{entry}\).*Fix: .*Compile\(\).*capture_step") as error:
        torch.compile(getattr(pm, entry), backend="aot_eager")(batch)
    assert "\n" not in str(error.value)
    assert torch.isfinite(pm.forward_backward(batch))  # eagerly, after the refusal, the step runs
