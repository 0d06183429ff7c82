"""compare.py --rounds: each round's pdserve / system ratios and their medians."""

from __future__ import annotations

from benchmarks import compare  # as tests import benchmarks.soak: no sys.path change


def _row(system: str, tok_s: float, ttft: float, tpot: float) -> dict:
    lat = {"median": 0.0, "p90": 0.0, "p99": 0.0}
    return {
        "system": system,
        "status": "ok",
        "metrics": {
            "output_throughput": tok_s,
            "ttft_ms": {**lat, "median": ttft},
            "tpot_ms": {**lat, "median": tpot},
        },
    }


def test_ratios_are_per_round_and_the_table_gives_their_median() -> None:
    rounds = [
        [_row("pdserve", 300.0, 400.0, 50.0), _row("vllm", 200.0, 800.0, 100.0)],
        [_row("pdserve", 200.0, 600.0, 80.0), _row("vllm", 200.0, 500.0, 80.0)],
        [_row("pdserve", 330.0, 300.0, 60.0), _row("vllm", 200.0, 600.0, 100.0)],
    ]
    got = compare.round_ratios(rounds)
    assert got["vllm"]["tok_s"] == [1.5, 1.0, 1.65]
    assert got["vllm"]["ttft_p50"] == [0.5, 1.2, 0.5]
    assert got["vllm"]["tpot_p50"] == [0.5, 1.0, 0.6]
    table = "\n".join(compare.rounds_table(got))
    assert "1.50 1.00 1.65 (median **1.50**)" in table
    assert "0.50 1.20 0.50 (median **0.50**)" in table


def test_a_round_without_pdserve_or_a_failed_system_counts_for_nothing() -> None:
    failed = {"system": "vllm", "status": "failed"}
    rounds = [
        [_row("pdserve", 300.0, 400.0, 50.0), failed],
        [{"system": "pdserve", "status": "failed"}, _row("vllm", 200.0, 800.0, 100.0)],
        [_row("pdserve", 300.0, 400.0, 50.0), _row("vllm", 100.0, 800.0, 100.0)],
    ]
    assert compare.round_ratios(rounds) == {
        "vllm": {"tok_s": [3.0], "ttft_p50": [0.5], "tpot_p50": [0.5]}
    }
