"""`Model`: what tomlens uses of a loaded model, as a type the rest of the package can name.

`load_model` returns a TransformerLens `TransformerBridge`, but only `tomlens.models` and
`tomlens.hooks` may import TransformerLens (ruff's banned-api rule): the other packages annotate
their `model` parameters with this protocol instead. It lists what they read and call, nothing
more, so a stand-in (a test double, another wrapper) needs only these members; the last function
below makes the type checker confirm that the bridge itself still has them (with their types, for
the members the bridge declares; `blocks` it reaches through `__getattr__`, which matches anything).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, suppress
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge


@runtime_checkable
class ModelConfig(Protocol):
    """The shape of the model, as TransformerLens's config gives it (read only here).

    Optional fields that not every architecture has (`n_key_value_heads`, `d_mlp`, `gated_mlp`,
    `dtype`) are read with `getattr(cfg, name, None)` and so are not part of the protocol.
    """

    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def d_head(self) -> int: ...
    @property
    def d_vocab(self) -> int: ...
    @property
    def n_ctx(self) -> int: ...


_ACCEPTED_MODELS: weakref.WeakSet[Any] = weakref.WeakSet()  # objects `isinstance(_, Model)` accepted


class _RemembersModels(type(Protocol)):  # type: ignore[misc]
    """`isinstance(x, Model)` that remembers each object it accepted.

    Why: on Python 3.11 the check reads every member, and the bridge's `hook_dict` property builds
    its whole alias table each time (a quarter of a millisecond on a 2-layer model); the test
    suite's checker asks it on every call with a `model` argument, an eighth of a validation run's
    time there. A loaded model does not lose members, so a yes is kept for the object's life
    (weakly; a test double that deletes a member after it was accepted stays accepted); a no, or an
    object that cannot be weakly referenced or hashed, is asked again each time. Only `Model`
    itself remembers. The memory is a module global: an attribute of the protocol, or an annotation
    here (which 3.11 reads through the class), would become one of its members.
    """

    def __instancecheck__(cls, instance: Any) -> bool:
        remembers = cls is Model  # a protocol or class derived from Model has members of its own
        if remembers and _remembered(instance):
            return True
        accepted = super().__instancecheck__(instance)
        if remembers and accepted:
            with suppress(TypeError):  # unhashable or not weakly referenceable: asked again next time
                _ACCEPTED_MODELS.add(instance)
        return accepted


def _remembered(instance: Any) -> bool:
    try:
        return instance in _ACCEPTED_MODELS  # False for what cannot be weakly referenced
    except TypeError:  # unhashable
        return False


# runtime_checkable: the test suite wraps the packages in beartype (tests/conftest.py), which checks
# every annotation on every call and can only check a protocol that `isinstance` accepts; that check
# sees that the members exist (on Python 3.11 it reads each one), not their types.
@runtime_checkable
class Model(Protocol, metaclass=_RemembersModels):
    """A loaded model as tomlens uses it: shape, tokenizer, forward call, hook points and blocks.

    `blocks[layer].attn` is the bridge's attention component (`W_O`, `b_O`, `original_component`);
    its members differ per architecture and TransformerLens types them loosely, so blocks are `Any`.
    The tokenizer is a Hugging Face fast tokenizer, typed `Any` as TransformerLens types it.
    """

    @property
    def cfg(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def hook_dict(self) -> Mapping[str, Any]: ...

    @property
    def blocks(self) -> Sequence[Any]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A forward: `model(input_ids, attention_mask=..., position_ids=..., return_type=...)`."""
        ...

    def hooks(self, fwd_hooks: list[Any] = ..., bwd_hooks: list[Any] = ...,
              reset_hooks_end: bool = ..., clear_contexts: bool = ...) -> AbstractContextManager[Any]:
        """Forward hooks `[(hook name, fn)]` attached for the `with` block, removed after."""
        ...

    def parameters(self, recurse: bool = ...) -> Iterator[nn.Parameter]: ...

    def named_parameters(self, prefix: str = ..., recurse: bool = ...,
                         remove_duplicate: bool = ...) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) pairs: the activation cache's weights fingerprint reads them."""
        ...


def _a_bridge_is_a_model(bridge: TransformerBridge) -> Model:
    """Never called: the type checker fails here if `TransformerBridge` stops matching `Model`."""
    return bridge


__all__ = ["Model", "ModelConfig"]
