"""The wheel nests passes/ and kernels/ under dtmega (nothing generic lands in site-packages);
the editable install this suite runs from resolves them from the source tree."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import dtmega.kernels
import dtmega.passes

ROOT = Path(__file__).resolve().parents[2]


def test_editable_install_maps_the_layers_to_the_source_folders():
    assert Path(dtmega.passes.__file__).resolve() == ROOT / "passes" / "__init__.py"
    assert Path(dtmega.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_wheel_contains_the_three_layers_under_dtmega(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("dtmega-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for required in ("dtmega/__init__.py", "dtmega/passes/__init__.py", "dtmega/passes/families/hf_llama.py",
                     "dtmega/kernels/cross_entropy.py", "dtmega/models/llama.py"):
        assert required in names, required
    assert not [n for n in names if n.split("/")[0] in ("passes", "kernels", "tests", "examples")]
