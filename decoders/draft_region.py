"""The draft phase as one compiled region (issue 46 item 2; ``linear``'s ``fused_draft``).

In compiled execution a greedy chain of K drafts is K compiled draft forwards, each launched from Python: per
forward the loop builds a mask and positions, sets the cache's write position, passes dynamo's guards and (on CUDA)
replays one CUDA graph. :func:`draft_chain` runs all K as ONE compiled function instead: the backlog forward, then
K - 1 single-token forwards, each fed the previous forward's argmax, unrolled inside the graph (on CUDA one CUDA graph,
``mode="reduce-overhead"``), with the masks and positions built in the graph from the layers' write position (a
device tensor: no host read, no recompile per length). transformers' ``StaticLayer.update`` advances each layer's
write position itself, so the K forwards write slots ``[L, L + w + K - 1)`` exactly as K separate compiled forwards
would. One graph per (feed width w in :data:`~dtbench.decoders.chain.DRAFT_FEEDS`, K): what
:func:`precompile_chain` compiles in a cell's compile step, outside any timed region.

The forwards stay observable: the model's forward pre-hooks fire once per fused forward before the region and its
forward hooks once per fused forward after it (:func:`_fire`), with the kwargs each forward has (its new tokens'
shape, the cache at its KV length, a 4D mask). The measurement's :class:`~dtbench.harness.measurement.forwards.ForwardCounter`
therefore counts K draft forwards of the same sizes and KV positions as without fusion and times the region as the
draft's forward seconds. What a pre-hook cannot see: the ids of forwards 2..K (they are the region's own argmaxes,
known only after it ran); it gets a (1, 1) stand-in (the feed's last id).

Where it does not apply (the proposer then runs its K forwards one by one, as before): eager execution, a chain cut
short near T (K below the declared one), the draft's prefill (its first iteration), a batch of rows (each row's
drafts run per forward). gpt-fast (pytorch-labs/gpt-fast ``generate.py``: ``decode_n_tokens``) compiles one decode
step and calls it per token; the unrolled K-step region here is the draft-phase analogue of its ``speculative_decode``
with the Python between draft steps taken out.
"""

from __future__ import annotations

from typing import Any

import torch

from dtbench.decoders.modelinfo import attention_mask_kind, cache_keyword, device_of, dtype_of
from dtbench.decoders.static_kv import Execution, StaticKV


def _region(execution: Execution, model: torch.nn.Module, k: int) -> Any:
    """The compiled K-draft function of ``model`` in ``execution`` (made once per (model, K, static length))."""
    key = (id(model), k, execution.max_len)
    fn = execution.regions.get(key)
    if fn is not None:
        return fn
    forward = type(model).forward.__get__(model)  # the module's forward: its hooks fire outside (_fire)
    keyword, max_len, dtype = cache_keyword(model), execution.max_len, dtype_of(model)
    additive = attention_mask_kind(model) != "bool"

    def chain(ids: torch.Tensor, cache: Any, written: torch.Tensor) -> torch.Tensor:
        start = written.clone()  # layer 0's write position L (0-d int64): the first forward advances the original
        slots = torch.arange(max_len, device=ids.device)
        drafts = []
        for _ in range(k):
            w = ids.shape[1]
            steps = torch.arange(w, device=ids.device)
            allowed = (slots < (steps + start + 1).unsqueeze(1)).view(1, 1, w, max_len)  # causal after the prefix
            mask: torch.Tensor = allowed
            if additive:
                zero = torch.zeros((), dtype=dtype, device=ids.device)
                mask = torch.where(allowed, zero, torch.full_like(zero, torch.finfo(dtype).min))
            out = forward(
                input_ids=ids,
                position_ids=(steps + start).unsqueeze(0),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{keyword: cache},
            )
            ids = torch.argmax(out.logits[:, -1], dim=-1).view(1, 1)
            drafts.append(ids)
            start = start + w
        return torch.cat(drafts, dim=1).view(-1)

    mode = "reduce-overhead" if device_of(model).type == "cuda" else None
    fn = execution.regions[key] = torch.compile(chain, mode=mode, dynamic=False)
    return fn


def _fire(model: torch.nn.Module, kwargs_each: list[dict[str, Any]], pre: bool) -> None:
    """Call ``model``'s own forward pre-hooks (``pre``) or forward hooks once per entry of ``kwargs_each``, as
    ``Module.__call__`` would around each forward (kwargs-taking hooks get the kwargs; forward hooks get ``None`` as
    the output: the region's logits never leave it). What a hook returns is ignored (the region's inputs are fixed)."""
    hooks = model._forward_pre_hooks if pre else model._forward_hooks
    with_kwargs = model._forward_pre_hooks_with_kwargs if pre else model._forward_hooks_with_kwargs
    for kwargs in kwargs_each:
        for hook_id, hook in list(hooks.items()):
            if hook_id in with_kwargs:
                hook(model, (), kwargs) if pre else hook(model, (), kwargs, None)
            else:
                hook(model, ()) if pre else hook(model, (), None)


def draft_chain(cache: StaticKV, model: torch.nn.Module, feed: list[int], k: int) -> torch.Tensor:
    """K greedy drafts of ``model`` continuing ``feed`` in one compiled region (see the module docstring).

    Args:
        cache: the draft's static cache after its prefill (``length`` > 0): ``feed`` goes at slots
            ``[length, length + len(feed))``; on return it holds ``len(feed) + k - 1`` more positions (the K-th
            draft is not fed, as with K separate forwards).
        model: the draft model the cache serves.
        feed: the 1 or 2 committed ids not yet in the cache (the backlog).
        k: drafts to make (K >= 1).

    Returns:
        The drafts, shape (K,) int64, on the model's device (not read: the chain loop verifies them as they are).

    Raises:
        ValueError: an empty cache (the prefill runs eager, by :meth:`StaticKV.forward`), a feed of other than 1 or
            2 ids, or positions past the static length.
    """
    cache._bind(model)
    ex, L, w = cache.execution, cache.length, len(feed)
    if L == 0 or w not in (1, 2) or k < 1:
        raise ValueError(f"a fused draft chain needs a prefilled cache and a feed of 1 or 2 ids (held {L}, fed {w})")
    if L + w + k - 1 > ex.max_len:
        raise ValueError(f"static KV cache of {ex.max_len} positions is full ({L} held, {w + k - 1} more fed)")
    region = _region(ex, model, k)
    dev = device_of(model)
    lengths = cache._lengths()
    torch._foreach_zero_(lengths)  # every layer's write position set to L (as StaticKV.forward_rows does)
    torch._foreach_add_(lengths, L)
    ids = torch.tensor([feed], dtype=torch.long, device=dev)
    hooked = bool(model._forward_pre_hooks or model._forward_hooks)
    if hooked:
        zero = ex.mask_values(dtype_of(model), dev)[0]
        kwargs_each = [
            {
                "input_ids": ids if i == 0 else ids[:, -1:],
                "attention_mask": zero.expand(1, 1, w if i == 0 else 1, ex.max_len),
                "use_cache": True,
                cache_keyword(model): _AtLength(cache.cache, L if i == 0 else L + w + i - 1),
            }
            for i in range(k)
        ]
        _fire(model, kwargs_each, pre=True)
    drafts = region(ids, cache.cache, lengths[0])
    if dev.type == "cuda":
        drafts = drafts.clone()  # a CUDA graph's output buffer is rewritten by its next replay
    if hooked:
        _fire(model, kwargs_each, pre=False)
    cache.length = L + w + k - 1
    cache.cache.dtbench_length = cache.length
    return drafts


class _AtLength:
    """The static cache as a hook sees it before one of the fused forwards: ``dtbench_length`` is that forward's KV
    length (:func:`dtbench.harness.measurement.forwards.past_length` reads it); everything else is the cache's own."""

    def __init__(self, cache: Any, length: int):
        self._cache, self.dtbench_length = cache, length

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.dtbench_length


def precompile_chain(execution: Execution, model: torch.nn.Module, k: int) -> None:
    """Compile :func:`draft_chain`'s graphs for ``k`` drafts (feeds of 1 and 2 ids) on ``model``, each run twice on
    a scratch static cache (on CUDA the second run records the CUDA graph), outside any timed region: a cell's
    compile step (:meth:`dtbench.harness.measurement.hardware.Hardware.compile_step`)."""
    with torch.inference_mode():
        from dtbench.decoders import static_kv

        with static_kv.compiled(execution):
            execution.begin_sample()
            cache = StaticKV(execution)
            dev = device_of(model)
            cache.forward(model, torch.zeros((1, 4), dtype=torch.long, device=dev), None, None, True)
            for w in (1, 2):
                for _ in range(2):
                    cache.length = 4
                    draft_chain(cache, model, [0] * w, k)
            execution.begin_sample()
