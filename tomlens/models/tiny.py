"""Random-weight models built from configs: the tiny offline test bed for every tomlens stage,
and full-size Llama shapes for speed and memory benchmarks on a GPU.

Three architectures cover the three ways positions and heads work: GPT-2 (learned absolute
positions), Llama with grouped-query attention (rotary, fewer KV heads than query heads) and
GPT-NeoX (partial rotary, parallel attention + MLP). Weights are random but fixed by the seed;
the tokenizer is the real SmolLM2 tokenizer, so stimuli tokenize exactly as on the embedded model.
It ships inside the package (`tokenizer_dir()`, Apache-2.0, see its NOTICE), so every model here
loads on a bare machine with only tomlens's dependencies: no model package, no GGUF reader.

`random-llama-1b` and `random-llama-8b` have the shapes of Llama-3.2-1B and Llama-3.1-8B
(layers, widths, heads, KV heads, MLP, the 128,256-row vocabulary) with random weights: what a
benchmark needs to measure throughput and memory offline, nothing it could learn from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's vocabulary
TOKENIZER_NAME = "smollm2-135m"  # the model whose tokenizer the random-weight models use


def tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer shipped as package data (extracted once from the embedded GGUF).

    Why shipped and not read from the GGUF: the benchmark shapes must load on a GPU machine that
    has tomlens's Python dependencies and nothing else; tests/test_shipped_tokenizer.py holds it
    equal to the GGUF's tokenizer (ids and offsets)."""
    return Path(__file__).parent / "tokenizers" / "smollm2"


@dataclass(frozen=True)
class TinySpec:
    """How to build one tiny model: its architecture family and a config factory."""

    name: str
    family: str
    description: str
    build_config: Callable[[], Any]
    full_size: bool = False  # built on the target device in the target dtype (too big for fp32 on CPU)


class _SpecialTokens(TypedDict):
    """Keyword arguments of a Hugging Face config (a TypedDict, so the checker knows each key's type)."""

    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


# Special-token ids of the three tiny configs (SmolLM2's tokenizer: 1 = <|im_start|>, 2 = <|im_end|>).
_TINY_TOKENS: _SpecialTokens = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def _gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_positions=512,
        architectures=["GPT2LMHeadModel"],
        **_TINY_TOKENS,
    )


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
        **_TINY_TOKENS,
    )


def _neox_config() -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        architectures=["GPTNeoXForCausalLM"],
        **_TINY_TOKENS,
    )


def _gemma3_config() -> Any:
    from transformers import Gemma3TextConfig

    # Gemma 3's shape in small: one KV head for all query heads, a short sliding window (4 tokens,
    # so it binds on every test story) on two layers and one global layer, as its 5:1 pattern does.
    return Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=32,  # not head_dim: a bridge that scaled by 1/sqrt(d_head) would differ
        intermediate_size=128,
        max_position_embeddings=512,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        architectures=["Gemma3ForCausalLM"],
        **_TINY_TOKENS,
    )


def _llama_shape(layers: int, width: int, heads: int, kv_heads: int, mlp: int, tied: bool) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=LLAMA3_VOCAB, num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
            num_key_value_heads=kv_heads, intermediate_size=mlp, max_position_embeddings=8192,
            # transformers 5 takes rope_theta through its legacy keywords (into rope_parameters), 4.x
            # as an argument: the one spelling both accept, though 5's signature does not list it
            rope_theta=500000.0,  # type: ignore[call-arg]
            tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            architectures=["LlamaForCausalLM"],
        )
    return build


LLAMA3_VOCAB = 128256  # Llama 3's vocabulary: the unembedding costs what it costs in the real model

TINY: dict[str, TinySpec] = {
    "tiny-gpt2": TinySpec(
        "tiny-gpt2", "gpt2", "random GPT-2, 2 layers, d_model 64, 4 heads (learned positions)", _gpt2_config
    ),
    "tiny-llama": TinySpec(
        "tiny-llama",
        "llama",
        "random Llama, 2 layers, d_model 64, 4 query heads / 2 KV heads (GQA, rotary)",
        _llama_config,
    ),
    "tiny-neox": TinySpec(
        "tiny-neox", "gpt_neox", "random GPT-NeoX, 2 layers, d_model 64, 4 heads (partial rotary)", _neox_config
    ),
    "tiny-gemma3": TinySpec(
        "tiny-gemma3", "gemma3",
        "random Gemma 3, 3 layers (2 sliding-window + 1 global), d_model 64, 4 query heads / 1 KV head",
        _gemma3_config,
    ),
    "random-llama-1b": TinySpec(
        "random-llama-1b", "llama",
        "random weights, Llama-3.2-1B shape: 16 layers, d_model 2048, 32 / 8 KV heads (benchmarks)",
        _llama_shape(16, 2048, 32, 8, 8192, tied=True), full_size=True,
    ),
    "random-llama-8b": TinySpec(
        "random-llama-8b", "llama",
        "random weights, Llama-3.1-8B shape: 32 layers, d_model 4096, 32 / 8 KV heads (benchmarks)",
        _llama_shape(32, 4096, 32, 8, 14336, tied=False), full_size=True,
    ),
}


def build_tiny(name: str, seed: int, device: Any = "cpu", dtype: Any = None,
               attn_implementation: str | None = None) -> Any:
    """The HF model for a random-weight name, with weights drawn from generators seeded by `seed`.

    Tiny models are built on the CPU in fp32 (the same weights on every machine; the caller casts
    and moves them). Full-size shapes are built directly on `device` in `dtype` (an 8B model in
    fp32 on a CPU would take 32 GB and minutes). The global RNG state is restored afterwards, so
    building a model never disturbs, and is never disturbed by, whatever else the caller seeded.
    """
    import torch
    from transformers import AutoModelForCausalLM

    spec = TINY[name]
    config = spec.build_config()
    config._attn_implementation = attn_implementation or ("sdpa" if spec.full_size else "eager")
    where = torch.device(device) if spec.full_size else torch.device("cpu")
    dt = (dtype or torch.float32) if spec.full_size else torch.float32
    cuda = [where.index or 0] if where.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), where:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    model.eval()
    return model
