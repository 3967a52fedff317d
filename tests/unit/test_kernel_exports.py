"""Every kernel docs/kernels.md's table names imports from `dtmega.kernels` as that function
(issue 47, item 10: `from dtmega.kernels import fused_linear_cross_entropy` gave the module),
also after its module was imported, which makes Python set the package attribute to the module."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def table_kernels() -> list[str]:
    """The first cell of each row of docs/kernels.md's kernel table (`| kernel | computes | ...`)."""
    text = (ROOT / "docs" / "kernels.md").read_text()
    table = text.split("| kernel | computes |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    names = [re.match(r"\| `([a-z_]+)` \|", row).group(1) for row in table]
    assert len(names) >= 6, names
    return names


@pytest.mark.parametrize("name", table_kernels())
def test_each_kernel_of_the_docs_table_imports_as_a_function(name):
    for module in ("rmsnorm", "swiglu", "rope", "fused_linear_cross_entropy", "recomputed_attention"):
        importlib.import_module(f"dtmega.kernels.{module}")  # the modules loaded first: the case that broke
    namespace: dict = {}
    exec(f"from dtmega.kernels import {name}", namespace)
    kernel = namespace[name]
    assert callable(kernel) and not isinstance(kernel, types.ModuleType), kernel
    assert getattr(importlib.import_module("dtmega.kernels"), name) is kernel
    assert name in importlib.import_module("dtmega.kernels").__all__


def test_the_modules_stay_importable_by_name():
    module = importlib.import_module("dtmega.kernels.fused_linear_cross_entropy")
    assert isinstance(module, types.ModuleType) and callable(module.fused_linear_cross_entropy_sum)
    from dtmega.kernels.swiglu import swiglu, swiglu_packed

    assert swiglu is importlib.import_module("dtmega.kernels").swiglu and callable(swiglu_packed)
