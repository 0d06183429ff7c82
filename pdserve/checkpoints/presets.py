"""Reference checkpoints: small, seeded, randomly initialised models in Hugging Face format.

`make_model("tiny", out)` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and generation_config.json; `transformers` loads the folder
offline. `default_model_path()` makes one on first use and caches it.

Init is chosen for *confident* logits, so greedy decoding does not flip on fp32
summation-order noise, and for layers that matter (attention output is as large
as the residual), so damaged KV changes the tokens. Special tokens get tiny
lm_head rows, so the models practically never emit EOS by chance.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where weights are made: `pdserve --help` stays fast
    import torch

from pdserve.checkpoints import tokenizer_build as tb
from pdserve.checkpoints.build_once import build_once
from pdserve.envs import cache_root

FORMAT_VERSION = 2  # bump when the files written here change; names the cache folder

LLAMA3_ROPE = (
    ("rope_type", "llama3"),
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 512),
)


@dataclass(frozen=True)
class ModelPreset:
    """Shapes of one reference model. head_dim = hidden_size // num_heads."""

    architecture: str  # LlamaForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 688
    vocab_size: int = 4096
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, str | float | int], ...] | None = None  # frozen dict
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def model_type(self) -> str:
        return {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(
            self.architecture, "qwen3"
        )

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    def describe(self) -> str:
        extras = [
            ("llama3 rope", self.rope_scaling is not None),
            ("tied embeddings", self.tie_word_embeddings),
            ("q/k/v bias", self.qkv_bias),
            ("q/k norm", self.qk_norm),
        ]
        return ", ".join(
            [self.architecture, f"{self.num_layers} layers", f"hidden {self.hidden_size}"]
            + [f"vocab {self.vocab_size}"]
            + [name for name, on in extras if on]
        )


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("LlamaForCausalLM"),
    "tiny-llama3": ModelPreset("LlamaForCausalLM", rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "tiny-qwen2": ModelPreset("Qwen2ForCausalLM", tie_word_embeddings=True),
    "tiny-qwen3": ModelPreset("Qwen3ForCausalLM"),
    "bench": ModelPreset(
        "LlamaForCausalLM",
        num_layers=8,
        hidden_size=512,
        intermediate_size=1408,
        vocab_size=32000,
        max_position_embeddings=8192,
    ),
}

# Init scales. Inputs to every projection are RMS-normed to ~1, so std c/sqrt(fan_in)
# gives outputs of std ~c. QK_SCALE > 1 sharpens attention (scores of std ~QK_SCALE**2);
# LOGIT_STD is the std of the logits, which keeps top-1/top-2 gaps far above fp32 noise.
QK_SCALE = 1.5
EMBED_STD = 1.0
LOGIT_STD = 4.0
BIAS_STD = 0.5
OUT_GAIN = 2.0  # o_proj / down_proj: layers outweigh the embedding, so context matters
SPECIAL_ROW_SCALE = 0.05  # lm_head rows of special tokens: logits ~20x smaller than the rest


def hf_config(p: ModelPreset) -> dict[str, object]:
    """config.json for preset `p` (transformers 4.4x and 5.x both read it)."""
    cfg: dict[str, object] = {
        "architectures": [p.architecture],
        "model_type": p.model_type,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "rope_scaling": dict(p.rope_scaling) if p.rope_scaling else None,
        "attention_bias": False,  # Qwen2 has q/k/v bias regardless of this flag
        "attention_dropout": 0.0,
        "tie_word_embeddings": p.tie_word_embeddings,
        "bos_token_id": tb.special_token_id(tb.BOS_TOKEN),
        "eos_token_id": tb.special_token_id(tb.EOS_TOKEN),
        "pad_token_id": tb.special_token_id(tb.EOS_TOKEN),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if p.model_type == "llama":
        cfg["mlp_bias"] = False
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_layers)
    return cfg


def generation_config() -> dict[str, object]:
    """Greedy by default; stops at `<|endoftext|>` or ChatML's `<|im_end|>`."""
    return {
        "bos_token_id": tb.special_token_id(tb.BOS_TOKEN),
        "eos_token_id": [tb.special_token_id(tb.EOS_TOKEN), tb.special_token_id(tb.IM_END)],
        "pad_token_id": tb.special_token_id(tb.EOS_TOKEN),
        "do_sample": False,
    }


def _layer_weights(p: ModelPreset, g: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    h, q_out, kv_out = p.hidden_size, p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight(n: int) -> torch.Tensor:  # far from 1, so a loader that skips it fails
        return 0.5 + torch.rand(n, generator=g)

    s = 1.0 / math.sqrt(h)
    yield "input_layernorm.weight", norm_weight(h)
    yield "self_attn.q_proj.weight", normal(q_out, h, std=QK_SCALE * s)
    yield "self_attn.k_proj.weight", normal(kv_out, h, std=QK_SCALE * s)
    yield "self_attn.v_proj.weight", normal(kv_out, h, std=s)
    if p.qkv_bias:
        yield "self_attn.q_proj.bias", normal(q_out, std=BIAS_STD)
        yield "self_attn.k_proj.bias", normal(kv_out, std=BIAS_STD)
        yield "self_attn.v_proj.bias", normal(kv_out, std=BIAS_STD)
    if p.qk_norm:
        yield "self_attn.q_norm.weight", norm_weight(p.head_dim)
        yield "self_attn.k_norm.weight", norm_weight(p.head_dim)
    yield "self_attn.o_proj.weight", normal(h, q_out, std=OUT_GAIN / math.sqrt(q_out))
    yield "post_attention_layernorm.weight", norm_weight(h)
    yield "mlp.gate_proj.weight", normal(p.intermediate_size, h, std=s)
    yield "mlp.up_proj.weight", normal(p.intermediate_size, h, std=s)
    yield (
        "mlp.down_proj.weight",
        normal(h, p.intermediate_size, std=OUT_GAIN * math.sqrt(2.0 / p.intermediate_size)),
    )


def init_weights(p: ModelPreset, seed: int) -> dict[str, torch.Tensor]:
    """All float32 tensors of preset `p`, keyed by Hugging Face names; a pure function of seed."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    specials = torch.arange(len(tb.SPECIAL_TOKENS))
    out = {"model.embed_tokens.weight": torch.randn(p.vocab_size, p.hidden_size, generator=g)}
    out["model.embed_tokens.weight"] *= EMBED_STD
    for i in range(p.num_layers):
        for name, t in _layer_weights(p, g):
            out[f"model.layers.{i}.{name}"] = t
    out["model.norm.weight"] = 0.5 + torch.rand(p.hidden_size, generator=g)
    if p.tie_word_embeddings:
        # Tied: the embedding doubles as lm_head, so it takes lm_head's scale.
        emb = out["model.embed_tokens.weight"]
        emb *= LOGIT_STD / (EMBED_STD * math.sqrt(p.hidden_size))
        emb[specials] *= SPECIAL_ROW_SCALE
    else:
        std = LOGIT_STD / math.sqrt(p.hidden_size)
        head = torch.randn(p.vocab_size, p.hidden_size, generator=g) * std
        head[specials] *= SPECIAL_ROW_SCALE
        out["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in out.items()}


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_model(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint of `preset` (a key of PRESETS) into `out_dir` and return it.

    The folder is created if needed; files of the same names are overwritten. Same
    preset and seed give byte-identical files.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", hf_config(p))
    _write_json(out / "generation_config.json", generation_config())
    from safetensors.torch import save_file

    save_file(init_weights(p, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    tb.build_tokenizer(p.vocab_size).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tb.tokenizer_config(p.max_position_embeddings))
    return out


def default_model_path(preset: str = "tiny") -> Path:
    """The cached checkpoint of `preset` (seed 0), made on first use (see build_once)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    target = cache_root() / "models" / f"v{FORMAT_VERSION}" / preset  # served as "<preset>"
    return build_once(target, lambda tmp: make_model(preset, tmp))


def _cli_make_model(args: argparse.Namespace) -> int:
    path = make_model(args.preset, args.out, seed=args.seed)
    p = PRESETS[args.preset]
    print(f"wrote {p.architecture} preset {args.preset!r} (seed {args.seed}) to {path}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register `pdserve make-model`."""
    lines = [f"  {name:12s} {p.describe()}" for name, p in PRESETS.items()]
    parser = subparsers.add_parser(
        "make-model",
        help="write a small random reference checkpoint (Hugging Face format)",
        description="Write a seeded, randomly initialised checkpoint in Hugging Face format\n"
        "(config.json, model.safetensors, tokenizer.json, tokenizer_config.json,\n"
        "generation_config.json) that transformers and pdserve both load offline.\n"
        "Same preset and seed give byte-identical weights.\n\npresets:\n" + "\n".join(lines),
        epilog="example: pdserve make-model --preset tiny-qwen3 --out /tmp/tiny-qwen3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape")
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    parser.set_defaults(func=_cli_make_model)
