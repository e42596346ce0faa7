"""Attention internals for AtP*'s query/key fix: each head's queries and keys as its scores see them,
the scores, the pattern and the score scale.

Patching a head's query or key moves its attention through a softmax; where that softmax is
saturated its gradient is near zero and attribution patching misses the effect. The fix recomputes
the softmax exactly with the patched queries or keys, which needs the inputs of the scores, not only
the head's output. This module is the one place that knows where TransformerLens exposes them.
`scores_from` rebuilds scores from queries and keys; `check_scores` confirms on real activations
that the rebuild reproduces the model's own scores, so an architecture that scores differently
(soft-capping, ALiBi, rotary applied where no hook sees it) fails with a message, not wrong numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.models.protocol import Model


@dataclass(frozen=True)
class AttentionHooks:
    """Hook names of one layer's attention internals.

    `q` / `k` are the projections a patch overwrites (`[batch, pos, head, d_head]`; keys and values
    have `n_key_value_heads` heads under grouped-query attention); `q_rot` / `k_rot` are the same
    vectors as the scores see them (after a rotary embedding, where the model has one).
    """

    q: str
    k: str
    q_rot: str
    k_rot: str
    scores: str
    pattern: str


def attention_hooks(model: Model, layer: int) -> AttentionHooks:
    base = f"blocks.{layer}.attn."
    hooks = model.hook_dict

    def rotated(name: str, plain: str) -> str:
        return base + name if base + name in hooks else base + plain

    return AttentionHooks(
        q=base + "hook_q", k=base + "hook_k", q_rot=rotated("hook_rot_q", "hook_q"),
        k_rot=rotated("hook_rot_k", "hook_k"), scores=base + "hook_attn_scores", pattern=base + "hook_pattern",
    )


def n_kv_heads(model: Model) -> int:
    """Key/value heads per layer (fewer than query heads under grouped-query attention)."""
    return int(getattr(model.cfg, "n_key_value_heads", None) or model.cfg.n_heads)


def is_joint_qkv(model: Model) -> bool:
    """Whether the bridge runs TransformerLens's joint-QKV attention (GPT-2, GPT-NeoX style), which
    softmaxes in the model's dtype and keeps its last pattern on the module (`_pattern`), so each
    layer holds a forward's pattern until the next forward replaces it. (Llama-style attention
    softmaxes in fp32 and keeps nothing.) Here, not in the planner, because only tomlens.hooks and
    tomlens.models know TransformerLens's classes."""
    try:
        from transformer_lens.model_bridge.generalized_components.joint_qkv_attention import (
            JointQKVAttentionBridge,
        )
        return isinstance(model.blocks[0].attn, JointQKVAttentionBridge)
    except (ImportError, AttributeError, IndexError, TypeError):
        return False


def score_scale(model: Model, layer: int) -> float:
    """The factor on q.k: the Hugging Face attention module's own `scaling`, else 1/sqrt(d_head)."""
    module = getattr(model.blocks[layer].attn, "original_component", None)
    scaling = getattr(module, "scaling", None)
    return float(scaling) if isinstance(scaling, (int, float)) else model.cfg.d_head ** -0.5


def qk_scores(
    q_rot: Float[Tensor, "batch q head d"], k_rot: Float[Tensor, "batch k kv d"], scale: float
) -> Float[Tensor, "batch head q k"]:
    """`scale * q.k` for every query head, unmasked (a key head serves `head / kv` query heads, as
    Hugging Face's `repeat_kv` does)."""
    rep = q_rot.shape[2] // k_rot.shape[2]
    k = k_rot.repeat_interleave(rep, dim=2) if rep > 1 else k_rot
    return torch.einsum("bqhd,bkhd->bhqk", q_rot, k.to(q_rot.dtype)) * scale


def scores_from(
    q_rot: Float[Tensor, "batch q head d"],
    k_rot: Float[Tensor, "batch k kv d"],
    scale: float,
    like: Float[Tensor, "batch head q k"],
) -> Float[Tensor, "batch head q k"]:
    """Attention scores as the model computes them, masked where `like` (its own scores) is."""
    s = qk_scores(q_rot.to(like.dtype), k_rot.to(like.dtype), scale)
    return s.masked_fill(masked(like), torch.finfo(torch.float32).min)


def masked(scores: Float[Tensor, "batch head q k"]) -> Tensor:
    """Where the model masked its scores (causal and padding): at the float32 minimum or below."""
    return scores <= torch.finfo(torch.float32).min / 2


def unsupported(layer: int, why: str) -> TomlensError:
    return TomlensError(
        f"the query/key fix cannot rebuild layer {layer}'s attention scores: {why}",
        "search heads (their outputs need no fix), or pass qk_fix=False for plain attribution on queries and keys",
    )


def score_error(
    rebuilt: Float[Tensor, "batch head q k"], scores: Float[Tensor, "batch head q k"]
) -> Float[Tensor, ""]:
    """How far rebuilt scores are from the model's own where it did not mask them, relative to the
    tolerance of float32 rounding (`<= 1`: they agree; 0 when everything is masked). A device
    scalar: a caller checking many layers reads them all at once, in one host sync."""
    keep = ~masked(scores)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    diff = torch.where(keep, (rebuilt - scores).abs(), zero).amax()
    scale = torch.where(keep, scores.abs(), zero).amax()
    return diff / (1e-4 * (1 + scale))


def check_scores(
    rebuilt: Float[Tensor, "batch head q k"], scores: Float[Tensor, "batch head q k"], layer: int
) -> None:
    """Fail when rebuilt scores differ from the model's own (beyond float32 rounding): one host
    sync (`score_error` gathers the difference on the device)."""
    error = float(score_error(rebuilt, scores))
    if not error <= 1:
        keep = ~masked(scores)
        diff = float((rebuilt - scores).abs()[keep].max())
        raise unsupported(layer, f"scale * q.k differs from the model's scores by up to {diff:.3g} (this "
                          "architecture scores attention in a way tomlens does not see: soft-capping, ALiBi, ...)")
