"""Tiny random-weight models built from configs: the offline test bed for every tomlens stage.

Three architectures cover the three ways positions and heads work: GPT-2 (learned absolute
positions), Llama with grouped-query attention (rotary, fewer KV heads than query heads) and
GPT-NeoX (partial rotary, parallel attention + MLP). Weights are random but fixed by the seed;
the tokenizer is the real SmolLM2 tokenizer, so stimuli tokenize exactly as on the embedded model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's vocabulary


@dataclass(frozen=True)
class TinySpec:
    """How to build one tiny model: its architecture family and a config factory."""

    name: str
    family: str
    description: str
    build_config: Callable[[], Any]


def _gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_positions=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        architectures=["GPT2LMHeadModel"],
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
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        architectures=["LlamaForCausalLM"],
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
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        architectures=["GPTNeoXForCausalLM"],
    )


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
}


def build_tiny(name: str, seed: int) -> Any:
    """The HF model for a tiny name, with weights drawn from a generator seeded by `seed`.

    A private generator (not the global RNG) is used so building a model never disturbs, and is
    never disturbed by, whatever else the caller seeded.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = TINY[name].build_config()
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):  # forks the CPU generator only
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model
