"""An evaluation harness scoring loglikelihoods through pdserve, against transformers.

    python benchmarks/eval_loglikelihood.py [--lm-eval /work/venv-eval/bin/lm-eval] [--model smollm2]

Runs EleutherAI's lm-evaluation-harness (`lm-eval`, installed in a venv of its own: its
dependencies would move pdserve's pins; see the message below when it is missing) twice
on the same multiple-choice task (benchmarks/eval_task/: a YAML task over a local jsonl,
no download), on the same checkpoint (the Hugging Face folder pdserve serves from its
cache):

  1. `local-completions` against `pdserve up`: each choice is one /v1/completions request
     with `echo: true, logprobs: 1, max_tokens: 1`; the harness sums the prompt logprobs
     of the continuation's tokens (computed by the prefill, carried to the decode);
  2. `hf`: transformers' forward on the same folder (float32, CPU).

It prints both accuracies and the largest |Δ loglikelihood| over all (question, choice)
pairs, and exits 1 when the accuracies differ or the gap exceeds --tolerance.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_e2e_pd import free_port, spawn, stop, wait_healthy  # noqa: E402

from pdserve.checkpoints.resolve import resolve_model  # noqa: E402

TASK_DIR = Path(__file__).resolve().parent / "eval_task"
TASK = "pdserve_mc"
INSTALL = "python -m venv /work/venv-eval && /work/venv-eval/bin/pip install 'lm-eval[api]==0.4.13'"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_lm_eval(lm_eval: str, model: str, model_args: str, out: Path) -> None:
    argv = [lm_eval, "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
            "--include_path", str(TASK_DIR), "--output_path", str(out), "--log_samples",
            "--batch_size", "8"]  # fmt: skip
    if model == "hf":
        argv += ["--device", "cpu"]
    env = {**os.environ, **OFFLINE}
    env.pop("PYTHONPATH", None)  # the harness's venv, not pdserve's tree
    subprocess.run(argv, cwd=TASK_DIR, env=env, check=True, timeout=1800)


def scores(out: Path) -> tuple[dict[str, float], dict[tuple[int, int], tuple[float, bool]]]:
    """(the task's accuracies, each (doc, choice)'s loglikelihood and whether the choice is
    the greedy continuation) from a run's files."""
    results = json.loads(Path(glob.glob(f"{out}/**/results_*.json", recursive=True)[0]).read_text())
    metrics = {k.split(",")[0]: v for k, v in results["results"][TASK].items()
               if k.startswith("acc") and "stderr" not in k}  # fmt: skip
    lls = {}
    for line in Path(glob.glob(f"{out}/**/samples_{TASK}_*.jsonl", recursive=True)[0]).open():
        s = json.loads(line)
        for j, (ll, greedy) in enumerate(s["filtered_resps"]):
            lls[(s["doc_id"], j)] = (float(ll), greedy == "True")
    return metrics, lls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lm-eval", default="/work/venv-eval/bin/lm-eval")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="largest |Δ loglikelihood|")
    args = ap.parse_args()
    if shutil.which(args.lm_eval) is None:
        print(f"lm-eval not found at {args.lm_eval}; install it in its own venv: {INSTALL}")
        return 2
    folder = str(resolve_model(args.model).path)
    work = Path(tempfile.mkdtemp(prefix="pdserve-eval-"))
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--model",
            folder, "--grace-period", "5"]  # fmt: skip
    proc = spawn(argv, "eval-up")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc], timeout_s=300.0)
        served = (f"model={folder},base_url=http://127.0.0.1:{port}/v1/completions,"
                  f"tokenizer_backend=huggingface,tokenizer={folder},num_concurrent=2,"
                  "max_retries=1")  # fmt: skip
        run_lm_eval(args.lm_eval, "local-completions", served, work / "pdserve")
    finally:
        stop(proc)
    run_lm_eval(args.lm_eval, "hf", f"pretrained={folder},dtype=float32", work / "hf")
    (acc_p, ll_p), (acc_h, ll_h) = scores(work / "pdserve"), scores(work / "hf")
    assert ll_p.keys() == ll_h.keys(), "the runs scored different requests"
    gap = max(abs(ll_p[k][0] - ll_h[k][0]) for k in ll_p)
    greedy_same = sum(ll_p[k][1] == ll_h[k][1] for k in ll_p)
    print(f"{TASK}: {len(ll_p)} (question, choice) loglikelihoods")
    for name in sorted(acc_p):
        print(f"  {name}: pdserve {acc_p[name]:.4f}, transformers {acc_h[name]:.4f}")
    print(f"  max |Δ loglikelihood| {gap:.2e} (tolerance {args.tolerance:g}); is_greedy "
          f"the same for {greedy_same} of {len(ll_p)}")  # fmt: skip
    print(f"  files: {work}")
    same = acc_p == acc_h and greedy_same == len(ll_p)
    return 0 if same and gap <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
