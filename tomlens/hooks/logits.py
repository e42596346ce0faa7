"""Which positions a forward unembeds.

Hugging Face causal LMs take `logits_to_keep=K` and unembed only the last `K` positions. At a 49k
vocabulary the unembedding is about a fifth of a small model's compute, so a caller that reads the
last few positions (a patching metric, an option's log-probs) passes it; models whose forward has
no such argument unembed every position and the caller slices.
"""

from __future__ import annotations

import inspect

from tomlens.models.protocol import Model


def keeps_last_logits(model: Model) -> bool:
    """Whether the wrapped HF model's forward takes `logits_to_keep` (read off its signature:
    remote-code and older forwards do not, and would raise on the keyword)."""
    hf = getattr(model, "original_model", None)
    if hf is None:
        return False
    try:
        return "logits_to_keep" in inspect.signature(hf.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False
