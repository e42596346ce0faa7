"""Sites, captures, patches and per-head outputs: the only place besides `tomlens.models` that
speaks TransformerLens. Everything else names a `Site` and a position selector."""

from tomlens.hooks.capture import capture
from tomlens.hooks.heads import attn_out_bias, head_out, w_o
from tomlens.hooks.sites import KINDS, PER_HEAD_KINDS, Site, check_sites, hook_name, parse_sites

__all__ = [
    "KINDS",
    "PER_HEAD_KINDS",
    "Site",
    "attn_out_bias",
    "capture",
    "check_sites",
    "head_out",
    "hook_name",
    "parse_sites",
    "w_o",
]
