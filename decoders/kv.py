"""Model forward and KV-cache operations shared by every decoder (target and draft alike).

The cache is a transformers ``DynamicCache``; its per-layer key/value tensors have shape
(batch=1, kv_heads, seq_len, head_dim). Rolling back and compacting act on those tensors directly, so the
operations are the same for every decoder and every architecture with full attention (Llama, GPT-NeoX, ...).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    """An empty KV cache."""
    return DynamicCache()


def cache_len(cache: DynamicCache) -> int:
    """Number of positions held in the cache (tokens)."""
    return cache.get_seq_length()


def forward(
    model: torch.nn.Module,
    token_ids: torch.Tensor | list[int],
    cache: DynamicCache,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = False,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` on new tokens appended after the cache, updating the cache in place.

    Args:
        model: a transformers causal LM.
        token_ids: the new tokens, shape (1, n) int64 or a list of n ints.
        cache: the model's KV cache; on return it holds n more positions.
        position_ids: shape (1, n) int64; default is consecutive positions after the cache.
        attention_mask: an already prepared 4D mask of shape (1, 1, n, cache_len + n) (see
            ``decoders.tree.tree_mask``), or None for plain causal attention.
        last_only: compute logits for the last position only (prefill: saves the LM head over the prompt).
        hidden_layers: also return the target's features from this same forward (no extra forward): the entries
            of transformers' ``hidden_states`` tuple at these indices (0 = embeddings, i = input of layer i,
            ``num_hidden_layers`` = the final-normed output), concatenated on the last axis. Learned drafting
            heads (EAGLE, Medusa) draft from them.

    Returns:
        Logits, shape (n, vocab) (or (1, vocab) with ``last_only``), in the model's dtype; with ``hidden_layers``
        the pair (logits, features (n, len(hidden_layers) * hidden_size) in the model's dtype).
    """
    if not torch.is_tensor(token_ids):
        token_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    kwargs = {}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if last_only:
        kwargs["logits_to_keep"] = 1
    if hidden_layers is not None:
        kwargs["output_hidden_states"] = True
    out = model(input_ids=token_ids, use_cache=True, **{cache_keyword(model): cache}, **kwargs)
    if hidden_layers is None:
        return out.logits[0]
    return out.logits[0], torch.cat([out.hidden_states[i][0] for i in hidden_layers], dim=-1)


@functools.cache
def _cache_keyword_of(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's ``forward`` takes its KV cache under: ``cache`` (transformers >= 5.2x models, where
    ``past_key_values`` is a deprecated alias that warns on every call) or ``past_key_values`` (older releases,
    remote-code and third-party modules)."""
    return _cache_keyword_of(type(model))


def crop(cache: DynamicCache, length: int) -> None:
    """Roll the cache back to its first ``length`` positions (paper section 3.5, step (i)).

    Raises:
        ValueError: if ``length`` is negative or longer than the cache.
    """
    current = cache_len(cache)
    if not 0 <= length <= current:
        raise ValueError(f"cannot crop a cache of {current} positions to {length}")
    if length == current:
        return
    for layer in cache.layers:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def keep_positions(cache: DynamicCache, prefix_len: int, indices: list[int]) -> None:
    """Keep the first ``prefix_len`` positions plus the positions ``indices`` (in that order), drop the rest.

    This is how an accepted tree path's key/value entries are kept without recomputing them (EAGLE-style
    compaction): ``indices`` are absolute cache positions, each >= ``prefix_len``, in path order.

    Raises:
        ValueError: if an index is out of range or precedes ``prefix_len``.
    """
    current = cache_len(cache)
    if any(i < prefix_len or i >= current for i in indices):
        raise ValueError(f"keep indices {indices} out of range [{prefix_len}, {current})")
    if indices == list(range(prefix_len, prefix_len + len(indices))):
        crop(cache, prefix_len + len(indices))  # already contiguous: a crop is a view, no copy
        return
    device = cache.layers[0].keys.device
    sel = torch.cat([torch.arange(prefix_len, device=device), torch.tensor(indices, device=device)])
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, sel)
        layer.values = layer.values.index_select(-2, sel)


def prefill(model: torch.nn.Module, input_ids: torch.Tensor):
    """Run the prompt through ``model`` into a fresh cache.

    Args:
        input_ids: shape (1, prompt_len) int64.

    Returns:
        (cache holding prompt_len positions, logits of the last prompt position, shape (vocab,)).
    """
    cache = new_cache()
    logits = forward(model, input_ids, cache, last_only=True)
    return cache, logits[-1]


def prefill_features(model: torch.nn.Module, input_ids: torch.Tensor, hidden_layers: tuple[int, ...]):
    """:func:`prefill` that also returns the prompt's features (see :func:`forward`'s ``hidden_layers``).

    Returns:
        (cache, last logits (vocab,), features (prompt_len, len(hidden_layers) * hidden_size)).
    """
    cache = new_cache()
    logits, features = forward(model, input_ids, cache, last_only=True, hidden_layers=hidden_layers)
    return cache, logits[-1], features
