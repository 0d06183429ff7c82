"""How often --quant-activations int8 picks the float path's greedy tokens, on real GGUFs.

    python benchmarks/int8_agreement.py [--models smollm2 gemma3-270m qwen2.5-coder-0.5b]
        [--tokens 64] [--json]

The int8 path is not "de-quantize, then the float matmul": each projection's input is
rounded to 8 bits per block (kernels/native/quant_int8.h), so its logits differ from the
float path's by that rounding and greedy tokens may part ways. Per model, a few fixed
prompts (prose, code, a list), `--tokens` greedy tokens each with `--quant-activations
float` and with `int8` (each its own engines, `pdserve.LLM`, weights from the file's
blocks); reported per prompt: the first position where the two differ (none: all equal)
and, after that, nothing (the texts have parted, so later tokens compare different
contexts). A measurement, not a test: the tests check the arithmetic
(tests/test_quant_int8.py), not the tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics

from pdserve import LLM, SamplingParams

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Here are five tips for a good night's sleep:\n1.",
    "Water boils at a lower temperature on a mountain because",
    "import numpy as np\n\n# multiply two matrices\n",
    "Once upon a time, in a small village by the sea,",
]


def greedy(model: str, acts: str, tokens: int) -> list[list[int]]:
    llm = LLM(model, weights="quantized", quant_activations=acts)
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = {}
    for model in args.models:
        base, int8 = greedy(model, "float", args.tokens), greedy(model, "int8", args.tokens)
        firsts = [first_difference(a, b) for a, b in zip(base, int8)]
        same = [args.tokens if f is None else f for f in firsts]
        report[model] = {"first_difference": firsts, "median_equal_prefix": statistics.median(same)}
        shown = ", ".join("none" if f is None else str(f) for f in firsts)
        print(f"{model}: first differing token per prompt ({args.tokens} greedy): {shown}; "
              f"{sum(f is None for f in firsts)}/{len(firsts)} prompts equal throughout", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps({"tokens": args.tokens, "prompts": PROMPTS, "models": report}))


if __name__ == "__main__":
    main()
