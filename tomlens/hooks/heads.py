"""Per-head contributions to the residual stream, from `z` and each head's slice of `W_O`.

"A head's output" in a probe or a patch means what that head alone adds to the residual stream:
`z_h @ W_O[h]`. Slicing the projected attention output would mix heads, because the output
projection sums over them. `TransformerBridge` reports `z` per query head even under grouped-query
attention, and `W_O` as `[n_heads, d_head, d_model]`, so GQA needs no special case here.
The heads' contributions plus the output bias `b_O` add up to `attn_out`. Gemma 2/3 normalise
the attention output before adding it to the residual stream (`ln1_post`, a "sandwich" norm):
there the heads add up to the projection output (`blocks.L.attn.hook_out`), and `attn_out` is
that sum normalised, so `head_out` is each head's share before the norm, not after it.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from tomlens.models.protocol import Model


def w_o(model: Model, layer: int) -> Float[Tensor, "head d_head d_model"]:
    """The output projection of `layer`, split per query head (detached: no weight gradients)."""
    return model.blocks[layer].attn.W_O.detach()


def attn_out_bias(model: Model, layer: int) -> Float[Tensor, " d_model"]:
    """The attention output bias `b_O` of `layer`; zeros for bias-free projections (Llama, NeoX without bias)."""
    bias = getattr(model.blocks[layer].attn, "b_O", None)
    if bias is None:
        weight = w_o(model, layer)
        return torch.zeros(weight.shape[-1], dtype=weight.dtype, device=weight.device)
    return bias.detach()


def head_out(
    model: Model, layer: int, z: Float[Tensor, "... head d_head"]
) -> Float[Tensor, "... head d_model"]:
    """Each head's write to the residual stream: `z[..., h, :] @ W_O[h]` for every head h.

    Gradients flow through `z` (attribution patching needs them), never into the weights.
    """
    weight = w_o(model, layer).to(z.dtype)
    return torch.einsum("...hd,hdm->...hm", z, weight)
