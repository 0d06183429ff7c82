"""multiturn.py: each turn's ratios between the servers, and the later turns' summary."""

from __future__ import annotations

import pytest

from benchmarks import multiturn  # as tests import benchmarks.compare: no sys.path change


def _fig(ttft_ms: list[float], tokens: int, wall: float, tpot: float = 10.0) -> dict:
    return {"ttft_ms": ttft_ms, "ttft_p50_ms": sorted(ttft_ms)[len(ttft_ms) // 2],
            "wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "tpot_p50_ms": tpot}  # fmt: skip


def _turn(t: int, on: dict, off: dict, vllm: dict | None = None) -> dict:
    servers = {"cache-on": on, "cache-off": off, **({"vllm": vllm} if vllm else {})}
    return {"turn": t, "order": list(servers), "servers": servers}


TURNS = [
    _turn(0, _fig([900.0], 100, 4.0), _fig([1000.0], 100, 5.0), _fig([500.0], 100, 2.0)),
    _turn(1, _fig([100.0], 100, 2.0), _fig([1000.0], 100, 4.0), _fig([200.0], 100, 2.5, 20.0)),
    _turn(2, _fig([300.0], 100, 1.0), _fig([1000.0], 100, 5.0), _fig([100.0], 100, 2.0)),
    _turn(3, _fig([200.0], 100, 2.0), _fig([800.0], 100, 4.0), _fig([400.0], 100, 1.0)),
]


def test_each_turn_has_its_ratios_numerator_over_denominator() -> None:
    got = multiturn.turn_ratios(TURNS)
    assert got["ttft_on_off"] == [0.9, 0.1, 0.3, 0.25]
    assert got["ttft_on_vllm"] == [1.8, 0.5, 3.0, 0.5]
    assert got["tok_s_on_vllm"] == pytest.approx([0.5, 1.25, 2.0, 0.5])
    assert got["tok_s_on_off"] == pytest.approx([1.25, 2.0, 5.0, 2.0])
    assert got["tpot_on_vllm"] == [1.0, 0.5, 1.0, 1.0]


def test_the_summary_covers_later_turns_only() -> None:
    s = multiturn.summary(TURNS)
    med = s["later_ratio_medians"]
    assert med["ttft_on_off"] == 0.25  # of 0.1, 0.3, 0.25: the first turn's 0.9 is left out
    assert med["tok_s_on_vllm"] == pytest.approx(1.25)
    assert s["later_ttft_p50_ms"] == {"cache-on": 200.0, "cache-off": 1000.0, "vllm": 200.0}
    assert s["later_tok_s"]["cache-on"] == pytest.approx(300 / 5.0)  # tokens over wall, summed
    assert s["later_tok_s"]["vllm"] == pytest.approx(300 / 5.5)
    assert s["later_ttft_p50_on_off"] == pytest.approx(0.2)
    assert s["all_tok_s"]["cache-on"] == pytest.approx(400 / 9.0)  # the first turn's too


def test_without_vllm_only_the_pdserve_ratios() -> None:
    turns = [_turn(t, r["servers"]["cache-on"], r["servers"]["cache-off"]) for t, r in
             enumerate(TURNS)]  # fmt: skip
    assert set(multiturn.turn_ratios(turns)) == {"ttft_on_off", "tok_s_on_off"}
    assert "vllm" not in multiturn.summary(turns)["later_tok_s"]


def test_ttft_stages_are_the_median_of_the_later_turns_p50s() -> None:
    later = [_turn(t, {**_fig([1.0], 1, 1.0), "ttft_breakdown_p50_ms": {"prefill": p, "kv": k}},
                   _fig([1.0], 1, 1.0)) for t, (p, k) in enumerate([(5, 1), (7, 2), (6, 9)])]  # fmt: skip
    assert multiturn.stage_medians(later, "cache-on") == {"kv": 2, "prefill": 6}
    assert multiturn.stage_medians(later, "cache-off") == {}


def test_cpu_of_later_turns_is_summed_by_process() -> None:
    def cpu(decode: float, router: float) -> dict:
        procs = [{"label": "decode engine", "cpu_s": decode}, {"label": "router", "cpu_s": router}]
        return {"server_cpu_s": decode + router, "machine_busy": 0.9, "processes": procs}

    later = [_turn(1, {**_fig([1.0], 100, 1.0), "cpu": cpu(1.5, 0.5)}, _fig([1.0], 1, 1.0)),
             _turn(2, {**_fig([1.0], 100, 1.0), "cpu": cpu(2.5, 0.5)}, _fig([1.0], 1, 1.0))]  # fmt: skip
    got = multiturn.later_cpu(later, "cache-on")
    assert got is not None
    assert got["server_cpu_s"] == 5.0
    assert got["tok_per_cpu_s"] == 40.0
    assert got["by_process"] == {"decode engine": 4.0, "router": 1.0}
    assert multiturn.later_cpu(later, "cache-off") is None  # no CPU figures: none made up
