"""A mixture-of-experts GGUF of realistic shape for pdserve against llama.cpp, and the bytes
a decode step reads from it.

    python benchmarks/moe_llamacpp.py make [--out DIR] [--quantize PATH] [--type Q4_K_M]
        [--layers 24] [--experts 64] [--top-k 8] [--hidden 1024] [--expert-size 512]
    python benchmarks/moe_llamacpp.py bytes FILE.gguf [--streams 1 16] [--tokens 32]

`make` writes a Qwen3-MoE (`qwen3moe`) GGUF as llama.cpp's converter lays it out: F16
matrices of random weights (normal, 1/sqrt(columns): a router with spread logits, so a
batch's tokens route to many experts), F32 norms and router, the byte-level BPE
tokenizer pdserve's presets use; then `llama-quantize` (built in the vendored llama.cpp
tree: `cmake --build build --target llama-quantize`) makes the Q4_K_M file both servers
read. Streamed tensor by tensor: memory stays at one expert tensor.

`bytes` serves the file with pdserve's offline engine pair (experts in the file's
blocks) and counts, per decode step and layer, the distinct experts the batch routes to
(model/arch/moe.py runs each once and reads no other): the bytes a step reads (routed
experts' blocks, every other matrix, the head; the embedding's rows are negligible)
against the weights' size.

The serving comparison is compare.py's, on the Q4_K_M file (docs/benchmarks.md):

    python benchmarks/compare.py --model FILE.gguf --llama-server PATH --skip vllm transformers \
        --rounds 2 --num-prompts 4 --concurrency 1 --input-len 64:64 --output-len 64:64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from pdserve.checkpoints import tokenizer_build as tb

sys.path.insert(0, str(Path(__file__).parent))
from moe_routed_bytes import routed_experts  # noqa: E402

VOCAB = 32768
HEAD_DIM, HEADS, KV_HEADS = 64, 16, 4


def _tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    model = json.loads(tb.build_tokenizer(vocab).to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    specials = {tb.special_token_id(s) for s in tb.SPECIAL_TOKENS}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_bos_token_id(tb.special_token_id(tb.BOS_TOKEN))
    w.add_eos_token_id(tb.special_token_id(tb.IM_END))
    w.add_add_bos_token(False)


def _tensors(a: argparse.Namespace) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape outermost first) of every tensor, in file order."""
    h, q, kv, e, i = a.hidden, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, a.experts, a.expert_size
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (VOCAB, h))]
    for n in range(a.layers):
        b = f"blk.{n}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)),
                (b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h)),
                (b + "attn_output.weight", (h, q)), (b + "attn_q_norm.weight", (HEAD_DIM,)),
                (b + "attn_k_norm.weight", (HEAD_DIM,)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_exps.weight", (e, i, h)),
                (b + "ffn_up_exps.weight", (e, i, h)), (b + "ffn_down_exps.weight", (e, h, i))]  # fmt: skip
    return [*out, ("output_norm.weight", (h,)), ("output.weight", (VOCAB, h))]


def _f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or "ffn_gate_inp" in name  # llama.cpp keeps norms and router F32


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:  # norms near 1
        return (0.8 + 0.4 * rng.random(shape, dtype=np.float32)).astype(np.float32)
    std = 1.0 if name == "token_embd.weight" else 1.0 / shape[-1] ** 0.5
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return w if _f32(name, shape) else w.astype(np.float16)


def write_f16(path: Path, a: argparse.Namespace) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(a.layers)
    w.add_context_length(4096)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.expert_size * 4)
    w.add_expert_feed_forward_length(a.expert_size)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.top_k)
    w.add_vocab_size(VOCAB)
    _tokenizer(w, VOCAB)
    tensors = _tensors(a)
    for name, shape in tensors:
        dtype = np.dtype(np.float32 if _f32(name, shape) else np.float16)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape in tensors:  # one tensor in memory at a time
        w.write_tensor_data(_values(name, shape, rng))
    w.close()
    return path


def make(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = f"{a.layers}L-{a.experts}x{a.expert_size}-top{a.top_k}-h{a.hidden}"
    f16, final = out / f"qwen3moe-{shape}-F16.gguf", out / f"qwen3moe-{shape}-{a.type}.gguf"
    if not final.exists():
        if not f16.exists():
            write_f16(f16, a)
        subprocess.run([a.quantize, str(f16), str(final), a.type], check=True)
        f16.unlink()
    print(final)


def _layer_bytes(path: Path) -> tuple[dict[int, int], int, int]:
    """(per layer: one expert's bytes in gate, up and down; bytes of every matrix a step
    reads whole; bytes of all tensors)."""
    from pdserve.checkpoints.gguf.index import read_index

    expert: dict[int, int] = {}
    dense = total = 0
    for t in read_index(path).tensors:
        n = int(t.n_bytes)
        total += n
        if "_exps." in t.name:
            layer = int(t.name.split(".")[1])
            expert[layer] = expert.get(layer, 0) + n // int(t.shape[-1])
        elif t.name != "token_embd.weight":
            dense += n
    return expert, dense, total


def bytes_per_step(a: argparse.Namespace) -> None:
    expert, dense, total = _layer_bytes(Path(a.file))
    rows = []
    for streams in a.streams:
        decode, wall = routed_experts(a.file, streams, a.tokens, max(a.streams) + 8, 30010)
        mean = sum(decode) / max(1, len(decode))
        routed = mean * sum(expert.values())  # each layer's mean routed experts' bytes
        rows.append({"streams": streams, "tok_per_s": streams * a.tokens / wall,
                     "experts_per_layer": mean, "read_mb_per_step": (routed + dense) / 1e6,
                     "weights_mb": total / 1e6})  # fmt: skip
    print(json.dumps(rows, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default="/tmp/pdserve-moe-bench")
    m.add_argument("--quantize", default="llama-quantize", help="llama.cpp's llama-quantize")
    m.add_argument("--type", default="Q4_K_M")
    m.add_argument("--layers", type=int, default=24)
    m.add_argument("--experts", type=int, default=64)
    m.add_argument("--top-k", type=int, default=8)
    m.add_argument("--hidden", type=int, default=1024)
    m.add_argument("--expert-size", type=int, default=512)
    b = sub.add_parser("bytes")
    b.add_argument("file")
    b.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    b.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    make(a) if a.cmd == "make" else bytes_per_step(a)


if __name__ == "__main__":
    main()
