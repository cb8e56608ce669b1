"""tools/verify_rows_bench.py: its counts on a tiny model (the figures themselves are docs/benchmarks.md's)."""

from __future__ import annotations

import json

from kvfork.tools import verify_rows_bench


def test_it_counts_one_sampled_row_per_token_and_the_rows_the_passes_gave(tiny_model_dir, capsys):
    assert verify_rows_bench.main(["--model", tiny_model_dir("llama"), "--backend", "torch", "--tokens", "12",
                                   "--concurrency", "2", "--dtype", "float32"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["concurrency"] == 2 and row["tokens"] == 2 * 2 * 12
    assert row["rows_sampled"] == row["tokens"]  # a sampled row is a token: none past a rejected draft
    assert row["drafted"] > 0 and row["rows_in_pass"] > row["rows_sampled"]
