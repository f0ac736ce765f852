"""Model forward and KV-cache operations shared by every decoder (target and draft alike).

Eager execution (the default): the cache is a transformers ``DynamicCache``; its per-layer key/value tensors have
shape (batch=1, kv_heads, seq_len, head_dim). Rolling back and compacting act on those tensors directly, so the
operations are the same for every decoder and every architecture with full attention (Llama, GPT-NeoX, ...).

Compiled execution (suite key ``execution: compiled``, issue 37): inside :func:`~dtbench.decoders.static_kv.compiled`
every cache :func:`new_cache` makes is a :class:`~dtbench.decoders.static_kv.StaticKV` (:mod:`dtbench.decoders.static_kv`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

import torch
from transformers import DynamicCache

from dtbench.decoders.modelinfo import attention_mask_kind, cache_keyword, device_of, dtype_of, layers
from dtbench.decoders.static_kv import StaticKV, current

if TYPE_CHECKING:
    pass

KVCache = DynamicCache | StaticKV  # what new_cache makes: eager or compiled execution


def new_cache() -> KVCache:
    """An empty KV cache: a ``DynamicCache``, or a :class:`StaticKV` inside :func:`compiled`."""
    execution = current()
    return DynamicCache() if execution is None else StaticKV(execution)


def cache_len(cache: KVCache) -> int:
    """Number of positions held in the cache (tokens)."""
    return cache.get_seq_length()


@overload
def forward(
    model: torch.nn.Module,
    token_ids: torch.Tensor | list[int],
    cache: KVCache,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = False,
    hidden_layers: None = None,
) -> torch.Tensor: ...


@overload
def forward(
    model: torch.nn.Module,
    token_ids: torch.Tensor | list[int],
    cache: KVCache,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = False,
    hidden_layers: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def forward(
    model: torch.nn.Module,
    token_ids: torch.Tensor | list[int],
    cache: KVCache,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = False,
    hidden_layers: tuple[int, ...] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def forward(
    model: torch.nn.Module,
    token_ids: torch.Tensor | list[int],
    cache: KVCache,
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
        token_ids = torch.tensor([token_ids], dtype=torch.long, device=device_of(model))
    if isinstance(cache, StaticKV):
        if hidden_layers is not None:
            raise ValueError("compiled execution does not return hidden states (learned drafting heads run eager)")
        return cache.forward(model, token_ids, position_ids, attention_mask, last_only)
    kwargs: dict[str, Any] = {}
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


def crop(cache: KVCache, length: int) -> None:
    """Roll the cache back to its first ``length`` positions (paper section 3.5, step (i)).

    Raises:
        ValueError: if ``length`` is negative or longer than the cache.
    """
    current = cache_len(cache)
    if not 0 <= length <= current:
        raise ValueError(f"cannot crop a cache of {current} positions to {length}")
    if isinstance(cache, StaticKV):  # a static cache rolls back by moving its length
        cache.length = length
        return
    if length == current:
        return
    for layer in layers(cache):
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def keep_positions(cache: KVCache, prefix_len: int, indices: list[int]) -> None:
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
    if isinstance(cache, StaticKV):  # an index copy of the kept positions to the slots after the prefix
        static = layers(cache.cache)
        dev = static[0].keys.device
        src = torch.tensor(indices, device=dev)
        dst = torch.arange(prefix_len, prefix_len + len(indices), device=dev)
        for layer in static:
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        cache.length = prefix_len + len(indices)
        return
    dynamic = layers(cache)
    device = dynamic[0].keys.device
    sel = torch.cat([torch.arange(prefix_len, device=device), torch.tensor(indices, device=device)])
    for layer in dynamic:
        layer.keys = layer.keys.index_select(-2, sel)
        layer.values = layer.values.index_select(-2, sel)


def prefill(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
    """Run the prompt through ``model`` into a fresh cache.

    Args:
        input_ids: shape (1, prompt_len) int64.

    Returns:
        (cache holding prompt_len positions, logits of the last prompt position, shape (vocab,)).
    """
    cache = new_cache()
    logits = forward(model, input_ids, cache, last_only=True)
    return cache, logits[-1]


def prefill_features(
    model: torch.nn.Module, input_ids: torch.Tensor, hidden_layers: tuple[int, ...]
) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """:func:`prefill` that also returns the prompt's features (see :func:`forward`'s ``hidden_layers``).

    Returns:
        (cache, last logits (vocab,), features (prompt_len, len(hidden_layers) * hidden_size)).
    """
    cache = new_cache()
    logits, features = forward(model, input_ids, cache, last_only=True, hidden_layers=hidden_layers)
    return cache, logits[-1], features


class RaggedBatch:
    """B sequences decoded together in one target: one right-padded cache with a length per row.

    Row r's committed positions are cache slots ``[0, lengths[r])``; the slots after them, up to the cache's width
    (the longest row), are padding that no query attends to. A forward feeds each row its own new tokens (ragged:
    n_r per row, padded to the longest) at slots ``[width, width + N)``, with per-row position ids
    (``lengths[r] + depth``) and a per-row 4D attention mask (the row's prefix, then the ancestor relation of its new
    tokens: causal for a chain, the tree mask of paper 3.4 for a tree). :meth:`keep` then moves each row's accepted
    entries right after its prefix and crops the padding, so every row keeps exactly its own accepted prefix (ragged
    acceptance, never cut to the shortest row); :meth:`retain` drops finished rows, which then cost no verification.

    Eager execution keeps a ``DynamicCache``. Compiled execution (issue 46 item 6) keeps a batch-B
    :class:`~dtbench.decoders.static_kv.StaticKV`: every forward after the prefill is padded to a bucket and runs the
    compiled graph of that (B, bucket), and a finished row stays in the batch as a padding row (it feeds one token that
    attends to itself, and its logits are dropped), so the batch keeps the shape its graphs were compiled for — as
    CUDA-graph engines pad a batch to a captured size (vLLM's ``cudagraph_capture_sizes``).

    The design follows the padded-batch verification of batched speculative decoding (BASS, Qian et al. 2024,
    "ragged" per-row lengths by masks and position ids) on transformers' 4D-mask path, the same path the one-row tree
    verification uses (:func:`dtbench.decoders.tree.structure.tree_attention_mask`).

    Args:
        model: a transformers causal LM whose attention takes an explicit 4D mask (sdpa or eager).

    Raises:
        ValueError: another attention implementation (it cannot take a per-row mask).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.kind = attention_mask_kind(model)
        self.cache = new_cache()
        self.lengths: list[int] = []
        self._width = 0  # cache width before the last forward (where its new tokens start)
        self._fed: list[int] = []  # new tokens per row in the last forward
        self._rows: list[int] = []  # compiled: the physical row of each row in the batch (finished rows stay)
        self._all: list[int] = []  # compiled: every physical row's length

    @property
    def rows(self) -> int:
        """Rows currently in the batch."""
        return len(self.lengths)

    def prefill(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Feed every row's prompt in one forward (right-padded); each row's last-position logits, (vocab,) each."""
        self.lengths = [0] * len(prompts)
        if isinstance(self.cache, StaticKV):
            from dtbench.decoders.static_kv import batch_owner

            self.cache.owner = batch_owner(len(prompts))
            self._rows, self._all = list(range(len(prompts))), [0] * len(prompts)
        last = sorted({len(p) - 1 for p in prompts})
        logits = self.forward(prompts, keep_logits=last)
        self.keep([list(range(len(p))) for p in prompts])
        return [logits[r, last.index(len(p) - 1)] for r, p in enumerate(prompts)]

    def forward(
        self,
        tokens: list[list[int]],
        ancestors: list[torch.Tensor | None] | None = None,
        depths: list[torch.Tensor | None] | None = None,
        keep_logits: list[int] | None = None,
    ) -> torch.Tensor:
        """One forward over every row's new tokens; the cache grows by the longest row's count.

        Args:
            tokens: per row the new token ids (n_r >= 1 each), in the order they are fed.
            ancestors: per row an (n_r, n_r) bool ancestor-or-self matrix among its new tokens (a tree), or None
                (a chain: causal); None for all rows: every row is a chain.
            depths: per row (n_r,) int64 position offsets of the new tokens after the row's prefix (a tree's node
                depths), or None (0, 1, ..., n_r - 1).
            keep_logits: compute logits only at these new-token indices (shared by all rows, transformers'
                ``logits_to_keep`` as a tensor); None: at every index.

        Returns:
            Logits (rows, N or len(keep_logits), vocab) in the model's dtype, N the longest row's n_r; entries past a
            row's n_r are padding.
        """
        dev = device_of(self.model)
        static = isinstance(self.cache, StaticKV)
        width = cache_len(self.cache)
        if static:  # every physical row: a finished one feeds its last position again, attending to itself
            where = dict(zip(self._rows, range(len(tokens)), strict=True))
            lengths_l = self._all
            tokens = [tokens[where[p]] if p in where else [0] for p in range(len(self._all))]
            every = range(len(self._all))
            ancestors = None if ancestors is None else [ancestors[where[p]] if p in where else None for p in every]
            depths = None if depths is None else [depths[where[p]] if p in where else None for p in every]
        else:
            lengths_l = self.lengths
        ids, pos, allowed = _ragged_inputs(tokens, ancestors, depths, lengths_l, width)
        if static:
            assert isinstance(self.cache, StaticKV)
            logits = self.cache.forward_rows(self.model, ids.to(dev), pos.to(dev), allowed.to(dev), keep_logits)
            logits = logits if len(where) == len(self._all) else logits[torch.tensor(self._rows, device=dev)]
        else:
            logits = self._forward_dynamic(ids, pos, allowed, keep_logits)
        self._width, self._fed = width, [len(t) for t in tokens]
        return logits

    def _forward_dynamic(
        self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, keep_logits: list[int] | None
    ) -> torch.Tensor:
        dev = device_of(self.model)
        allowed = allowed.unsqueeze(1).to(dev)
        if self.kind == "bool":
            mask = allowed
        else:
            dtype = dtype_of(self.model)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
        kwargs: dict[str, Any] = {}
        if keep_logits is not None:
            kwargs["logits_to_keep"] = torch.tensor(keep_logits, dtype=torch.long, device=dev)
        out = self.model(
            input_ids=ids.to(dev),
            position_ids=pos.to(dev),
            attention_mask=mask,
            use_cache=True,
            **{cache_keyword(self.model): self.cache},
            **kwargs,
        )
        return out.logits

    def keep(self, kept: list[list[int]]) -> None:
        """After :meth:`forward`: row r keeps its new tokens ``kept[r]`` (indices into its new tokens, increasing)
        right after its prefix; every other new entry and all padding past the longest row are dropped.

        Only the kept entries move (an in-place copy to lower slots); the cache is then cropped to the longest row.
        """
        width = self._width
        static = isinstance(self.cache, StaticKV)
        src_b, src_s, dst_s = [], [], []
        for r, idx in enumerate(kept):
            b = self._rows[r] if static else r
            for i, u in enumerate(idx):
                if width + u != self.lengths[r] + i:
                    src_b.append(b)
                    src_s.append(width + u)
                    dst_s.append(self.lengths[r] + i)
            self.lengths[r] += len(idx)
            if static:
                self._all[b] = self.lengths[r]
        if src_b:
            rows = layers(self.cache.cache if isinstance(self.cache, StaticKV) else self.cache)
            dev = rows[0].keys.device
            b_i = torch.tensor(src_b, device=dev)
            s_i, d_i = torch.tensor(src_s, device=dev), torch.tensor(dst_s, device=dev)
            for layer in rows:
                layer.keys[b_i, :, d_i] = layer.keys[b_i, :, s_i]
                layer.values[b_i, :, d_i] = layer.values[b_i, :, s_i]
        crop(self.cache, max(self._all if static else self.lengths, default=0))

    def retain(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the current rows, in order): finished rows leave the batch (compiled:
        they stay in the static batch as padding rows, their slots untouched)."""
        if rows == list(range(self.rows)):
            return
        self.lengths = [self.lengths[r] for r in rows]
        if isinstance(self.cache, StaticKV):
            self._rows = [self._rows[r] for r in rows]
            return
        if not rows:
            self.cache = new_cache()
            return
        batch = layers(self.cache)
        dev = batch[0].keys.device
        sel = torch.tensor(rows, device=dev)
        for layer in batch:
            layer.keys = layer.keys.index_select(0, sel)
            layer.values = layer.values.index_select(0, sel)
        crop(self.cache, max(self.lengths))


def _ragged_inputs(
    tokens: list[list[int]],
    ancestors: list[torch.Tensor | None] | None,
    depths: list[torch.Tensor | None] | None,
    lengths: list[int],
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`RaggedBatch.forward`'s host-built inputs: ids and position ids (b, N) int64 and the attention
    relation (b, N, width + N) bool (each row's prefix, then its new tokens' relation; padding attends to itself)."""
    b, n = len(tokens), max(len(t) for t in tokens)
    length_t = torch.tensor(lengths)
    aligned = ancestors is None and depths is None and all(len(t) == n for t in tokens)
    if aligned:  # every row a chain of n tokens (batched AR, equal drafts): one tensor op per input, no row loop
        ids = torch.tensor(tokens, dtype=torch.long)
        pos = length_t.unsqueeze(1) + torch.arange(n)
        new = torch.ones(n, n, dtype=torch.bool).tril_().expand(b, n, n)
    else:
        ids = torch.zeros((b, n), dtype=torch.long)
        pos = torch.zeros((b, n), dtype=torch.long)
        new = torch.eye(n, dtype=torch.bool).repeat(b, 1, 1)  # padding queries attend to themselves only
    for r, row in enumerate([] if aligned else tokens):
        m = len(row)
        ids[r, :m] = torch.as_tensor(row, dtype=torch.long)
        ids[r, m:] = ids[r, m - 1]
        d = depths[r] if depths is not None and depths[r] is not None else None
        pos[r, :m] = lengths[r] + (d.cpu() if d is not None else torch.arange(m))
        pos[r, m:] = lengths[r]
        a = ancestors[r] if ancestors is not None and ancestors[r] is not None else None
        new[r, :m, :m] = a.cpu() if a is not None else torch.ones(m, m, dtype=torch.bool).tril_()
    prefix = torch.arange(width) < length_t.unsqueeze(1)  # (b, width)
    return ids, pos, torch.cat([prefix.unsqueeze(1).expand(b, n, width), new], dim=2)
