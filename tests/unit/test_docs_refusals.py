"""What the docs call unsupported is what the code refuses, and nothing else.

docs/serving.md listed `--load-hf` as not built (it works) and docs/training.md called
`--fp8-format` refused (it works). Now one table in docs/training.md ("Not built yet") is the
list of refused features, row for row the code's (`dtmega/train/not_built.py`); every row's
example is run through `dtmega train ... --dry-run` and must be refused with the row's reason;
any other sentence or table row of README.md and docs/*.md that calls a flag unsupported or not
built must name a flag of that table; and the flags of the serving page's "Not built" section
must be ones `dtmega serve` does not take."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtmega.train.not_built import NOT_BUILT
from tests.train_helpers import prepare_corpus, tiny_args

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
UNSUPPORTED = re.compile(r"not supported|unsupported|not built", re.I)
FLAG = re.compile(r"`(--[a-z0-9][a-z0-9-]*)")


def table_rows() -> list[tuple[str, str]]:
    """(flag cell, reason cell) of docs/training.md's not-built table."""
    text = (ROOT / "docs" / "training.md").read_text()
    table = text.split("<!-- not-built-table -->", 1)[1].strip().split("\n\n", 1)[0].splitlines()[2:]
    rows = []
    for line in table:
        flag, reason = (cell.strip() for cell in line.strip().strip("|").split(" | ", 1))
        rows.append((flag.strip("`").replace("\\|", "|"), reason.strip()))
    return rows


def claims(text: str):
    """Table rows and prose sentences (the units a claim lives in)."""
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if not line.lstrip().startswith("<!--")]
        if lines and all(line.lstrip().startswith("|") for line in lines):
            yield from lines
        else:
            yield from re.split(r"(?<=[.;:])\s+", " ".join(lines))


def test_the_docs_table_is_the_codes_list():
    assert table_rows() == [(item.flags, item.reason) for item in NOT_BUILT]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=60)


@pytest.mark.parametrize("item", NOT_BUILT, ids=[item.flags for item in NOT_BUILT])
def test_every_row_is_refused_by_a_dry_run_with_its_reason(item, corpus, capsys):
    from dtmega.cli import main

    line = [flag for flag in tiny_args(corpus) if flag not in item.without]
    assert main(["train", *line, *item.example, "--dry-run", "1"]) == 2
    assert f"{item.flags}: {item.reason}" in capsys.readouterr().err


def test_help_marks_every_choice_it_then_refuses():
    """`dtmega train --help` offers only what works, or says which choices do not: every choice
    that a not-built row refuses is marked in its flag's help."""
    from dtmega.train.args import build_parser, parse_train_args

    base = ["--swiglu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4"]
    unmarked = []
    for action in build_parser()._actions:
        for choice in action.choices or ():
            args = parse_train_args([*base, action.option_strings[0], str(choice)])[0]
            refused = [item.flags for item in NOT_BUILT if item.applies(args)]
            help_text = action.help or ""
            if refused and "not supported" not in help_text and "only " not in help_text:
                unmarked.append(f"{action.option_strings[0]} {choice}")
    assert not unmarked, unmarked


def test_no_page_calls_a_flag_unsupported_outside_the_table():
    allowed = {flag for cell, _ in table_rows() for flag in re.findall(r"--[a-z0-9][a-z0-9-]*", cell)}
    stray = []
    for path in DOCS:
        for claim in claims(path.read_text()):
            if UNSUPPORTED.search(claim):
                stray += [f"{path.name}: {flag} in {claim[:120]!r}" for flag in FLAG.findall(claim) if flag not in allowed]
    assert not stray, "\n".join(stray)


def test_the_servers_not_built_section_names_no_flag_the_server_takes():
    from dtmega.serve.cli import build_parser

    section = (ROOT / "docs" / "serving.md").read_text().split("## Not built", 1)[1].split("\n## ", 1)[0]
    taken = {option for action in build_parser()._actions for option in action.option_strings}
    assert not [flag for flag in FLAG.findall(section) if flag in taken]
