"""Typed accessors of a transformers model and its KV cache (torch's and transformers' own annotations are looser
than what dtbench's caches hold): the model's device, dtype and config, the keyword its forward takes a cache by, a
cache's full-attention layers, and the 4D-mask format its attention takes (:func:`attention_mask_kind`: here, not in
the tree toolkit, so the KV caches read it at module level without an import cycle; issue 58 item 6)."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Literal, Protocol, cast

import torch

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedConfig

MaskKind = Literal["bool", "additive"]


def device_of(model: torch.nn.Module) -> torch.device:
    """``model.device``: the device of a transformers model (``nn.Module``'s stubs type unknown attributes as
    ``Tensor | Module``)."""
    return cast(torch.device, model.device)


def dtype_of(model: torch.nn.Module) -> torch.dtype:
    """``model.dtype``: the parameters' dtype of a transformers model."""
    return cast(torch.dtype, model.dtype)


def config_of(model: torch.nn.Module) -> PreTrainedConfig:
    """``model.config``: a transformers model's configuration."""
    return cast("PreTrainedConfig", model.config)


class KVLayer(Protocol):
    """One attention layer of a transformers cache once it has been fed (``DynamicLayer``, ``StaticLayer``): keys
    and values of shape (batch, kv_heads, slots, head_dim)."""

    keys: torch.Tensor
    values: torch.Tensor


def layers(cache: Cache) -> list[KVLayer]:
    """``cache.layers``, typed as full-attention layers holding tensors.

    transformers types them as a union with linear-attention and dummy layers (no ``keys``), and ``keys``/``values``
    as None before the first update; the caches dtbench edits belong to full-attention models and have been fed.
    """
    return cast("list[KVLayer]", cache.layers)


@functools.cache
def _cache_keyword_of(cls: type) -> str:
    try:
        params = inspect.signature(cast(type[torch.nn.Module], cls).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's ``forward`` takes its KV cache under: ``cache`` (transformers >= 5.2x models, where
    ``past_key_values`` is a deprecated alias that warns on every call) or ``past_key_values`` (older releases,
    remote-code and third-party modules)."""
    cls: type = type(model)  # as builtins.type: mypy does not see type[Module] as Hashable (the cache's key)
    return _cache_keyword_of(cls)


def attention_mask_kind(model: torch.nn.Module) -> MaskKind:
    """The 4D-mask format ``model``'s attention implementation needs (transformers 5.x uses it as-is).

    Returns:
        "additive" for ``eager`` (it adds the mask to the scores: 0 where allowed, dtype-min elsewhere);
        "bool" for ``sdpa`` (True = attend).

    Raises:
        ValueError: for any other implementation (flash_attention_2/3, flex_attention, ...): they accept only
            causal/padding masks and cannot express a tree.
    """
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl == "eager":
        return "additive"
    if impl == "sdpa":
        return "bool"
    raise ValueError(
        f"tree attention needs an explicit 4D attention mask, which attention implementation {impl!r} cannot "
        "take; load the model with attn_implementation='sdpa' or 'eager'"
    )
