"""Model names -> TransformerBridge (embedded SmolLM2, tiny test models, hub ids, local folders),
provenance of what was loaded, text -> left-padded token batches, and `Model`: the type of a loaded
model everywhere else in tomlens."""

from tomlens.models.protocol import Model, ModelConfig
from tomlens.models.registry import DEFAULT_MODEL, ModelName, list_models, load_model, load_tokenizer, provenance
from tomlens.models.tokens import EncodedBatch, encode

__all__ = [
    "DEFAULT_MODEL",
    "EncodedBatch",
    "Model",
    "ModelConfig",
    "ModelName",
    "encode",
    "list_models",
    "load_model",
    "load_tokenizer",
    "provenance",
]
