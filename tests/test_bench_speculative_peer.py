"""speculative.py's llama.cpp side: the llama-server command for each speculation kind,
the draft counts read from its streamed timings, and the one-stream report's ratios."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import speculative  # no sys.path change (as test_soak imports benchmarks.soak)

speculative_peer = speculative.speculative_peer


def test_ngram_simple_drafts_k_tokens_after_a_lookup_of_n() -> None:
    assert speculative_peer.spec_flags("ngram-simple", 8, 4) == [
        "--spec-type", "ngram-simple",
        "--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "8",
    ]  # fmt: skip


def test_ngram_mod_gets_a_minimum_draft_its_maximum_allows() -> None:
    flags = speculative_peer.spec_flags("ngram-mod", 8, 4)
    assert flags[:2] == ["--spec-type", "ngram-mod"]
    sizes = dict(zip(flags[2::2], flags[3::2], strict=True))
    assert sizes == {"--spec-ngram-mod-n-match": "4", "--spec-ngram-mod-n-max": "8",
                     "--spec-ngram-mod-n-min": "1"}  # fmt: skip


def test_every_kind_offered_names_its_own_size_flags() -> None:
    for kind, (lookup, draft) in speculative_peer.SIZE_FLAGS.items():
        assert lookup.startswith(f"--spec-{kind}-") and draft.startswith(f"--spec-{kind}-")


def test_server_argv_has_one_slot_the_gguf_and_the_spec_flags() -> None:
    spec = speculative_peer.spec_flags("ngram-simple", 8, 4)
    argv = speculative_peer.server_argv(Path("/b/llama-server"), Path("/m.gguf"), 8123, 4096,
                                        spec, "--flash-attn on")  # fmt: skip
    assert argv[0] == "/b/llama-server"
    opt = {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}
    assert opt["--model"] == "/m.gguf" and opt["--port"] == "8123"
    assert opt["--host"] == "127.0.0.1" and opt["--parallel"] == "1"
    assert opt["--ctx-size"] == "4096" and opt["--spec-type"] == "ngram-simple"
    assert argv[-2:] == ["--flash-attn", "on"]
    off = speculative_peer.server_argv(Path("/b/s"), Path("/m.gguf"), 1, 4096, [])
    assert "--spec-type" not in off


def test_draft_counts_come_from_the_last_chunks_timings() -> None:
    last = {"choices": [], "usage": {"completion_tokens": 128},
            "timings": {"predicted_n": 128, "draft_n": 123, "draft_n_accepted": 105}}  # fmt: skip
    assert speculative_peer.draft_counts(last) == (123, 105)
    no_draft = {"timings": {"predicted_n": 128}}  # llama.cpp leaves them out when off
    assert speculative_peer.draft_counts(no_draft) is None
    assert speculative_peer.draft_counts({"choices": [{"delta": {"content": "x"}}]}) is None


def test_only_a_named_binary_brings_llama_cpp_in() -> None:
    ap = argparse.ArgumentParser()
    speculative_peer.add_args(ap)
    assert not speculative_peer.wanted(ap.parse_args([]))
    assert speculative_peer.wanted(ap.parse_args(["--llama-server", "/b/llama-server"]))


def test_report_prints_the_four_p50s_and_the_ratio_against_llama_cpp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    modes = [speculative.Mode(label, "u") for label in
             (speculative.PD_ON, speculative.PD_OFF, speculative.LL_ON, speculative.LL_OFF)]  # fmt: skip
    for m, ms, text in zip(modes, (50, 200, 40, 100), ("ab", "ab", "ac", "ac"), strict=True):
        m.tpot = [ms / 1e3, ms / 1e3, 1.0]
        m.text = text
    modes[2].spec["spec_drafted_tokens_total"] = 10
    modes[2].spec["spec_accepted_tokens_total"] = 8
    speculative.report(modes, "w")
    out = capsys.readouterr().out
    assert "w: TPOT p50 pdserve on / llama.cpp on = 1.25" in out
    assert "w: TPOT p50 pdserve on / pdserve off = 0.25" in out
    assert "w: TPOT p50 llama.cpp on / llama.cpp off = 0.40" in out
    assert "w llama.cpp on: one stream TPOT p50 40.0 ms; drafted 10, accepted 8 (80%)" in out
    assert "answers of pdserve on and pdserve off the same" in out
    assert "answers of pdserve on and llama.cpp on differ after 1 characters" in out
