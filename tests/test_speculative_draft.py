"""Speculative decoding with a draft model (`--speculative draft`, scheduler/draft.py):
greedy output with it equals the output without it, token for token; the draft's own KV
follows the verified tokens (rejected positions discarded) and every draft row and page
comes back when requests end.

Two drafts for the tiny model: the tiny model itself (its drafts are the model's own
tokens: all accepted, and with chosen draft tokens corrupted, a known mix of accepted
and rejected ones), and a random Qwen3 preset of another shape sharing its tokenizer
(drafts mostly rejected at once).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import partial
from pathlib import Path

import msgspec
import pytest
import torch

from pdserve.checkpoints.presets import ModelPreset, hf_config, init_weights
from pdserve.config import SpeculativeConfig
from pdserve.llm import LLM
from pdserve.protocol import EngineRequest
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler import draft as draft_mod
from pdserve.scheduler import spec_launch, speculation
from pdserve.scheduler.draft import DraftProposer
from pdserve.scheduler.draft_load import load_draft
from pdserve.scheduler.speculation import Speculator
from tests.conftest import assert_pools_free

PAIR = ModelPreset("Qwen3ForCausalLM", num_layers=2, hidden_size=128, num_heads=4,
                   num_kv_heads=1, intermediate_size=256)  # fmt: skip
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def write_draft(tiny: Path, out: Path, preset: ModelPreset = PAIR, seed: int = 3) -> Path:
    """A random preset's folder with the tiny model's tokenizer and generation config."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(preset)))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, out / name)
    save_file(init_weights(preset, seed), str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def pair_model(tiny_model, tmp_path_factory) -> Path:
    return write_draft(tiny_model, tmp_path_factory.mktemp("draft") / "pair")


@pytest.fixture(scope="module")
def llms(tiny_model):
    """(page size, overlap) -> an LLM whose decode drafts with the tiny model itself."""
    spec = SpeculativeConfig("draft", k=4, max_batch=4, draft_model=str(tiny_model))
    made = {
        (ps, overlap): LLM(tiny_model, page_size=ps, max_context=160, max_total_tokens=2048,
                           max_running_requests=4, disable_overlap=not overlap, speculative=spec)
        for ps, overlap in ((1, True), (16, False))
    }  # fmt: skip
    yield made
    for llm in made.values():
        llm.close()


@pytest.fixture(scope="module")
def pair_draft(llms, pair_model):
    """The random preset's draft runner beside the (16, False) decode."""
    llm = llms[16, False]
    spec = SpeculativeConfig("draft", k=4, max_batch=4, draft_model=str(pair_model))
    return load_draft(dataclasses.replace(llm.cfg, speculative=spec), llm.decode.runner)


def speculator(llm: LLM, k: int, runner=None) -> Speculator:
    """A fresh speculator drafting with `runner` (default: the decode's own draft model)."""
    own = llm.decode.spec
    assert own is not None and own.draft is not None
    draft = DraftProposer(runner or own.draft.runner, partial(spec_launch.forward_now, llm.decode))
    return Speculator(SpeculativeConfig("draft", k=k, max_batch=4, draft_model="x"), draft)


def run(llm: LLM, prompts, params, spec: Speculator | None):
    """Each prompt with its own params, in one batch; every pool free afterwards."""
    from pdserve.llm import RequestOutput

    saved, llm.decode.spec = llm.decode.spec, spec
    try:
        outs = {}
        for i, (p, q) in enumerate(zip(prompts, params)):
            rid = f"d{id(outs)}-{i}"
            outs[rid] = RequestOutput(prompt=p)
            er = EngineRequest(rid=rid, input_ids=p, params=q, room=i + 1)
            llm.prefill.add_request(er)
            llm.decode.add_request(er)
        llm._run(outs)
    finally:
        llm.decode.spec = saved
    assert_pools_free(llm)
    if spec is not None and spec.draft is not None:
        assert_draft_free(spec)
    return [(o.token_ids, o.finish_reason) for o in outs.values()]


def assert_draft_free(spec: Speculator) -> None:
    assert spec.draft is not None
    s = spec.draft.stats()
    assert not spec.draft.seqs
    assert s["spec_draft_free_rows"] == s["spec_draft_total_rows"], s
    assert s["spec_draft_free_kv_pages"] == s["spec_draft_total_kv_pages"], s


def with_(p: SamplingParams, **kw) -> SamplingParams:
    return msgspec.structs.replace(p, **kw)


class Corrupt:
    """Draft picks with the token at chosen output indexes replaced (a wrong draft token
    the target rejects there), each pick recorded as (rid, first output index of its
    draft, its output index, token)."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.picks: list[tuple[str, int, int, int]] = []
        self.right = DraftProposer._pick

    def __call__(self, proposer, req, greedy, q, index):
        tok = self.right(proposer, req, greedy, q, index)
        if index in self.bad:
            tok = (tok + 1) % 4096
        self.picks.append((req.rid, len(req.output_ids), index, tok))
        return tok

    def install(self, monkeypatch) -> Corrupt:
        monkeypatch.setattr(DraftProposer, "_pick", lambda *a: self(*a))
        return self


PROMPTS = [[7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45]]
CASES = [  # (prompts, max_tokens, k, draft, corrupted output indexes, stop)
    (PROMPTS[:1], 13, 4, "self", {3, 4, 9}, None),
    (PROMPTS, 11, 3, "self", {2, 7}, "stop"),
    (PROMPTS[1:], 9, 6, "self", set(), "eos"),
    (PROMPTS[:2], 12, 4, "pair", set(), None),
    (PROMPTS, 7, 2, "pair", set(), "stop"),
]


CASE_CFGS = [  # the random preset drafts beside the page-16 decode only
    (case, cfg)
    for case in range(len(CASES))
    for cfg in ((1, True), (16, False))
    if CASES[case][3] == "self" or cfg == (16, False)
]


@pytest.mark.parametrize(("case", "cfg"), CASE_CFGS)
def test_greedy_tokens_equal_with_draft(llms, pair_draft, monkeypatch, cfg, case):
    """Several prompts in one batch, k, max_tokens landing inside a draft (13 and 9 are
    no multiple of the k + 1 a fully accepted step yields), a stop token and EOS inside
    a draft."""
    prompts, max_tokens, k, which, bad, stop = CASES[case]
    llm = llms[cfg]
    Corrupt(bad).install(monkeypatch)
    params = [with_(GREEDY, max_tokens=max_tokens)] * len(prompts)
    arch = llm.decode.runner.arch
    off = run(llm, prompts, params, None)
    if stop is not None:  # a token the first answer reaches mid-draft ends it there
        tok = off[0][0][5]
        if stop == "eos":
            eos = dataclasses.replace(arch, eos_token_ids=(tok,))
            monkeypatch.setattr(llm.decode.runner, "arch", eos)
            params = [with_(params[0], ignore_eos=False), *params[1:]]
        else:
            params = [with_(params[0], stop_token_ids=[tok]), *params[1:]]
        off = run(llm, prompts, params, None)
    spec = speculator(llm, k, pair_draft if which == "pair" else None)
    on = run(llm, prompts, params, spec)
    assert on == off
    assert spec.steps > 0 and spec.drafted > 0
    if which == "self" and not bad:
        assert spec.accepted == spec.drafted  # the model drafting for itself
    if bad:
        assert 0 < spec.accepted < spec.drafted


def test_model_drafting_for_itself_accepts_every_token(llms):
    llm = llms[1, True]
    spec = speculator(llm, 4)
    on = run(llm, PROMPTS, [GREEDY] * 3, spec)
    assert on == run(llm, PROMPTS, [GREEDY] * 3, None)
    assert spec.drafted > 0 and spec.accepted == spec.drafted
    assert llm.decode.stats()["spec_acceptance_rate"] == 1.0 or llm.decode.spec is not spec


def test_long_catch_ups_run_in_chunks_and_as_extends(llms, monkeypatch):
    """A prompt longer than a catch-up chunk: its head in chunks, its tail in an extend
    forward, the drafting steps in decode batches; the model drafting for itself still
    has every draft token accepted (its KV is right on every path)."""
    monkeypatch.setattr(draft_mod, "CATCH_UP_CHUNK", 8)
    monkeypatch.setattr(draft_mod, "ONE_TOKEN_ENTRIES", 4)
    llm = llms[16, False]
    prompts = [list(range(100, 130)), list(range(200, 213))]
    spec = speculator(llm, 4)
    on = run(llm, prompts, [GREEDY] * 2, spec)
    assert on == run(llm, prompts, [GREEDY] * 2, None)
    assert spec.drafted > 0 and spec.accepted == spec.drafted
    assert spec.draft is not None and spec.draft.catch_up_tokens >= 43


def _alternate(monkeypatch) -> None:
    """Speculating steps take turns with ordinary ones, so outputs that the draft model
    never saw come between its drafts (its catch-up reads them)."""
    real = Speculator.batch_may

    def every_other(self, batch, waiting):
        self.turn = not getattr(self, "turn", False)
        return self.turn and real(self, batch, waiting)

    monkeypatch.setattr(Speculator, "batch_may", every_other)


def _stale_picks(llm: LLM, monkeypatch, bad: set[int]) -> int:
    """Draft tokens that the draft model (the tiny model itself) should have proposed
    right but did not: those whose draft has no corrupted token before them. Its drafts
    are the reference tokens as long as its KV holds the request's tokens."""
    corrupt = Corrupt(bad).install(monkeypatch)
    _alternate(monkeypatch)
    params = [with_(GREEDY, max_tokens=24)] * 2
    ref = run(llm, PROMPTS[:2], params, None)
    spec = speculator(llm, 4)
    assert run(llm, PROMPTS[:2], params, spec) == ref
    assert spec.steps > 0 and 0 < spec.accepted < spec.drafted
    stale = 0
    for rid, start, index, tok in corrupt.picks:
        expected = ref[int(rid.rsplit("-", 1)[1])][0]
        clean = not any(start <= b <= index for b in bad)
        stale += clean and index < len(expected) and tok != expected[index]
    return stale


BAD_PICKS = {2, 3, 8, 9, 14, 19}


def test_draft_kv_follows_the_verified_tokens(llms, monkeypatch):
    """After each verification the draft's KV of rejected positions is discarded, so its
    next drafts read the request's real tokens: every draft token before a corrupted
    one is the reference token."""
    assert _stale_picks(llms[1, True], monkeypatch, BAD_PICKS) == 0


def test_broken_draft_rollback_is_caught(llms, monkeypatch):
    """Keeping the draft KV of one rejected position (the position of the target's own
    token) makes later drafts read a wrong token: the check above finds them."""
    monkeypatch.setattr(draft_mod, "kept_positions", lambda held, total: min(held, total))
    assert _stale_picks(llms[1, True], monkeypatch, BAD_PICKS) > 0


def test_broken_acceptance_rule_is_caught(llms, pair_draft, monkeypatch):
    """Accepting one draft token more than the model agrees with changes the output."""
    right = speculation.accept_greedy
    monkeypatch.setattr(speculation, "accept_greedy",
                        lambda d, t: min(len(d), right(d, t) + 1))  # fmt: skip
    llm = llms[16, False]
    off = run(llm, PROMPTS[:1], [GREEDY], None)
    on = run(llm, PROMPTS[:1], [GREEDY], speculator(llm, 4, pair_draft))
    assert on != off


def test_aborted_requests_free_their_draft_rows_and_pages(llms):
    llm = llms[1, True]
    spec = speculator(llm, 4)
    saved, llm.decode.spec = llm.decode.spec, spec
    try:
        rids = [f"abort-{i}" for i in range(2)]
        for i, rid in enumerate(rids):
            er = EngineRequest(rid=rid, input_ids=PROMPTS[i], params=with_(GREEDY, max_tokens=100),
                               room=90 + i)  # fmt: skip
            llm.prefill.add_request(er)
            llm.decode.add_request(er)
        for _ in range(200):  # a bound: a few steps reach the drafting
            llm.prefill.step()
            llm.decode.step()
            if spec.steps >= 2 and len(spec.draft.seqs) == 2:  # type: ignore[union-attr]
                break
        assert len(spec.draft.seqs) == 2  # type: ignore[union-attr]
        for rid in rids:
            llm.decode.abort(rid)
        llm.decode.step()
        llm.decode.drain()
        while llm.prefill.has_unfinished():
            llm.prefill.step()
    finally:
        llm.decode.spec = saved
    assert_pools_free(llm)
    assert_draft_free(spec)


def test_sampled_requests_draft_and_end_cleanly(llms, pair_draft, monkeypatch):
    """Requests that sample draw their draft tokens from the draft model's q, which the
    verification gets (min(1, p/q), the residual max(0, p - q)): each ends at max_tokens
    with every page of both pools back."""
    from pdserve.scheduler import spec_step

    seen = []
    right = spec_step.verify_sampled

    def verify(draft, probs, seed, index, q=None):
        seen.append((list(draft), q))
        return right(draft, probs, seed, index, q)

    monkeypatch.setattr(spec_step, "verify_sampled", verify)
    llm = llms[16, False]
    spec = speculator(llm, 3, pair_draft)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, ignore_eos=True)
    on = run(llm, PROMPTS[:2], [sampled] * 2, spec)
    assert [len(t) for t, _ in on] == [12, 12]
    assert all(r == "length" for _, r in on)
    assert spec.steps > 0 and spec.drafted > 0
    drafted = [(d, q) for d, q in seen if d]
    assert drafted
    for draft, q in drafted:  # each draft token was drawn from the q verified against
        assert q is not None and q.shape[0] >= len(draft)
        assert all(q[j, t] > 0 for j, t in enumerate(draft))
        assert all(int((q[j] > 0).sum()) <= 50 for j in range(len(draft)))  # top_k applied


CHI2_DF4_P001 = 18.47  # chi-square with 4 degrees of freedom: exceeded with probability 0.001


def _chi2(counts: list[float], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_rejection_sampling_with_the_drafts_q_keeps_the_target():
    """On a 5-token vocabulary: draft tokens drawn from q, verified against p. The first
    token emitted follows p, and the draft is kept as often as min(1, p/q) keeps it
    (sum of min(p, q)); the one-hot rule (keep d with probability p(d)) would keep it
    far less often (sum of p q), a rule drawing from p instead of the residual
    max(0, p - q) on a rejection would emit another distribution."""
    from pdserve.scheduler.spec_sampling import draw_draft, verify_sampled

    p = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    q = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    probs = torch.stack([p, p])
    counts, kept, n = [0] * 5, 0, 3000
    for seed in range(n):
        d = draw_draft(q, seed, 3)
        first = verify_sampled([d], probs, seed, 3, q[None])[0]
        counts[first] += 1
        kept += first == d  # a rejection never emits d: the residual is 0 there
    assert _chi2(counts, p.tolist()) < CHI2_DF4_P001, counts
    both = torch.minimum(p, q)
    sd = (both.sum() * (1 - both.sum()) / n).sqrt().item()
    assert abs(kept / n - both.sum().item()) < 4 * sd, kept
    assert abs(kept / n - (p * q).sum().item()) > 4 * sd  # the one-hot rule's rate
    from_p = both + (1 - both.sum()) * p  # rejections drawn from p: not p
    assert _chi2((n * from_p).tolist(), p.tolist()) > CHI2_DF4_P001


def _folder(tiny: Path, out: Path, **config) -> Path:
    """The tiny model's config files (no weights: the check comes first), changed."""
    out.mkdir()
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        shutil.copy(tiny / name, out / name)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **config}))
    return out


def test_a_draft_of_another_vocabulary_is_refused(llms, tiny_model, tmp_path):
    llm = llms[16, False]
    target = llm.decode.runner

    def refusal(path: Path) -> str:
        spec = SpeculativeConfig("draft", draft_model=str(path))
        with pytest.raises(ValueError) as e:
            load_draft(dataclasses.replace(llm.cfg, speculative=spec), target)
        return str(e.value)

    assert "vocabulary has 2048 ids" in refusal(
        _folder(tiny_model, tmp_path / "v", vocab_size=2048)
    )
    eos = _folder(tiny_model, tmp_path / "e")
    gen = json.loads((eos / "generation_config.json").read_text())
    (eos / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [7]}))
    assert "end-of-sequence ids [0, 7] differ" in refusal(eos)
    special = _folder(tiny_model, tmp_path / "s")
    tok = json.loads((special / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] = "<|other|>"
    (special / "tokenizer.json").write_text(json.dumps(tok))
    assert "special tokens differ" in refusal(special)


def test_draft_flags(tiny_model):
    """--draft-model goes to decodes only, is resolved like --model, and is refused by
    name without --speculative draft (and --speculative draft without it)."""
    import argparse

    from pdserve.server.launch import flag_value, split_decode_flags
    from pdserve.server.serve_cli import add_cli, configs_from_args

    args = ["--speculative", "draft", "--draft-model", "tiny", "--page-size", "4"]
    assert split_decode_flags(args) == (["--page-size", "4"], args[:4])
    assert flag_value(args[:4], "--draft-model") == "tiny"  # `pdserve up` resolves it first
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["decode", "--model", "tiny", *args[:4]])
    spec = configs_from_args("decode", ns)[1].engine.speculative
    assert (spec.mode, Path(spec.draft_model)) == ("draft", tiny_model)
    with pytest.raises(SystemExit):  # the prefill has no such flag
        parser.parse_args(["prefill", "--draft-model", "tiny"])
    with pytest.raises(ValueError, match="--draft-model is only for --speculative draft"):
        SpeculativeConfig("ngram", draft_model="tiny")
    with pytest.raises(ValueError, match="--speculative draft needs --draft-model"):
        SpeculativeConfig("draft")
