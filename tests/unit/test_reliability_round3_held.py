"""Reliability matrix 3's GOOD rows that had no test of their own (issue 48: every row names a
test that asserts it): chat templates that recurse, escape the sandbox, name undefined things or
arrive inside a message (C5, C7, C8, C9), tokenizer files that are JSON but not a tokenizer
(F15), a TOML file naming modules to import (A7), and a rendezvous store that is gone (T3)."""

from __future__ import annotations

import pytest

from dtmega.data.chat_template import ChatTemplate, ChatTemplateError
from dtmega.kernels.errors import DtmegaError

SHORT = [{"role": "user", "content": "hi"}]


def test_c5_unbounded_macro_recursion_is_refused():
    with pytest.raises(ChatTemplateError, match=r"cannot render these messages|did not finish rendering"):
        ChatTemplate("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recur.jinja").render(SHORT)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ (lipsum|attr('__globals__'))['os'].system('touch MARKER') }}",
    "{{ raise_exception.__globals__ }}",
])
def test_c7_the_sandbox_holds(template, tmp_path, monkeypatch):
    """Jinja's sandbox refuses attribute access to internals; nothing runs (the marker is never made)."""
    monkeypatch.chdir(tmp_path)
    try:
        text = ChatTemplate(template, "escape.jinja").render(SHORT)
    except ChatTemplateError as error:
        assert "unsafe" in str(error) or "undefined" in str(error) or "cannot render" in str(error), error
    else:
        assert "posix" not in text and "<function" not in text, text
    assert not (tmp_path / "MARKER").exists()


def test_c8_an_undefined_name_is_named():
    with pytest.raises(ChatTemplateError, match=r"'undefined_thing' is undefined"):
        ChatTemplate("{{ undefined_thing.x }}", "t.jinja").render(SHORT)


def test_c9_jinja_inside_a_message_is_text():
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    text = ChatTemplate(template, "t.jinja").render([{"role": "user", "content": "{{ 7*7 }}{% for i in range(9) %}x"
                                                                                "{% endfor %}"}])
    assert "{{ 7*7 }}{% for i in range(9) %}x{% endfor %}" in text and "49" not in text


@pytest.mark.parametrize("content", ["TRUNCATED", "{\"a\":" + "[" * 100_000 + "]" * 100_000 + "}"])
def test_f15_json_that_is_not_a_tokenizer_is_one_line(tmp_path, content):
    from dtmega.data.tokenizers import tokenizer_from_path
    from tests.hf_models import save_tiny_llama31

    if content == "TRUNCATED":
        good = save_tiny_llama31(tmp_path / "hf") / "tokenizer.json"
        content = good.read_text()[:5000]
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(DtmegaError, match=r"is JSON but not a tokenizers file"):
        tokenizer_from_path(tmp_path / "tokenizer.json")


def test_a7_a_toml_custom_import_is_the_flags_and_only_imports_what_it_names(tmp_path):
    """A TOML file's custom_import imports modules, as the flag does (by design: docs/training.md
    says a config file is code-equivalent to its command line); it names what it imports."""
    from dtmega.train.args import parse_train_args

    (tmp_path / "run.toml").write_text('custom_import = ["tests.user_models"]\nlr = 1e-3\n')
    args, _ = parse_train_args(["--config", str(tmp_path / "run.toml")])
    assert list(args.custom_import) == ["tests.user_models"]
    (tmp_path / "bad.toml").write_text('custom_import = ["no_such_module_here"]\nlr = 1e-3\n')
    with pytest.raises(DtmegaError, match=r"--custom-import no_such_module_here: No module named"):
        parse_train_args(["--config", str(tmp_path / "bad.toml")])


def test_t3_a_store_that_is_gone_is_said_and_a_lost_peer_is_one_line():
    """Matrix 3, T3: rank 0 (which hosts the store) killed: the survivor's report says the store
    did not answer instead of hanging on it, and names the broken connection."""
    from dtmega.train.watch import RankMarks

    class GoneStore:
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

        def get(self, key):
            raise RuntimeError("Connection reset by peer")

    marks = RankMarks.__new__(RankMarks)
    marks.rank, marks.world, marks.store, marks.step, marks.phase = 1, 2, GoneStore(), 5, "forward/backward"
    marks.keys, marks.clock_offsets = ["dtmega/progress/0", "dtmega/progress/1"], [0.0, 0.0]
    assert marks.where_everyone_is() == ["ranks 0-1: unknown (the store did not answer)"]
    error = marks.explain_lost_peer(RuntimeError("[gloo] Connection reset by peer"))
    assert "rank 1: the connection to a peer broke at step 5, in forward/backward" in str(error)
    assert "Fix: look at that node's logs" in str(error)
