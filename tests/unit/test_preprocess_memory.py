"""Preprocessing streams its input: a 200 MB JSONL stays far under 1 GB of memory, counted over
the whole process tree (driver and workers)."""

from __future__ import annotations

from benchmarks.preprocess import measure, synthetic_jsonl


def test_200mb_input_stays_under_1gb(tmp_path):
    source = synthetic_jsonl(tmp_path / "input.jsonl", size_mb=200)
    assert source.stat().st_size >= 200e6
    for workers in (1, 2):
        result = measure(source, tmp_path, workers=workers, tokenizer="byte")
        assert result["peak_rss_mib"] < 1024, result
        assert result["mb_per_second"] > 1, result
