"""Plans that need 8 real ranks (PP x TP x DP), launched as their own torchrun job of 8 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import GRAD_RTOL, LOSS_RTOL, PARAM_RTOL

ROOT = Path(__file__).resolve().parents[2]


def test_pp2_tp2_sp_fsdp2_matches_unsharded(tmp_path):
    out = tmp_path / "errors.json"
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "8", "--local-ranks-filter", "0",
               "-m", "tests.scripts.pp_tp_dp_numerics", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    for schedule, errors in json.loads(out.read_text()).items():
        assert errors["loss"] <= LOSS_RTOL and errors["grad"] <= GRAD_RTOL and errors["param"] <= PARAM_RTOL, (schedule, errors)
