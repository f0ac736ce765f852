"""Model forward and KV-cache operations shared by every decoder (target and draft alike).

Eager execution (the default): the cache is a transformers ``DynamicCache``; its per-layer key/value tensors have
shape (batch=1, kv_heads, seq_len, head_dim). Rolling back and compacting act on those tensors directly, so the
operations are the same for every decoder and every architecture with full attention (Llama, GPT-NeoX, ...).

Compiled execution (suite key ``execution: compiled``, issue 37): inside :func:`compiled` every cache
:func:`new_cache` makes is a :class:`StaticKV`, a preallocated transformers ``StaticCache`` whose logical length is a
Python int: rolling back is moving that length, compaction an index copy of the accepted positions to the slots
after the prefix, and every forward a 4D mask over the static length. Every forward after a cache's first (the
prefill, which runs eager) is padded to a bucket size (:data:`BUCKETS`, after vLLM's CUDA-graph capture sizes) and
runs the model's forward compiled by ``torch.compile`` (``mode="reduce-overhead"``, CUDA graphs, on CUDA; inductor on
CPU), so the decoders' loops are unchanged and nothing recompiles once every bucket has been compiled
(:meth:`Execution.precompile`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, cast, overload

import torch
from transformers import DynamicCache

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedConfig

# Forward sizes (new tokens per row) compiled execution pads to: powers of two as vLLM's default CUDA-graph capture
# sizes are. A forward of more new tokens than the largest runs eager (a long prompt's prefill is never compiled).
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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


def bucket(n: int) -> int | None:
    """The smallest bucket holding ``n`` new tokens, or None when ``n`` exceeds the largest (runs eager)."""
    for b in BUCKETS:
        if n <= b:
            return b
    return None


class Execution:
    """Compiled execution for one worker: the compiled forwards and static caches, shared by every compiled cell.

    One ``torch.compile`` of each model's forward (``dynamic=False``: one graph per bucket size, compiled once in
    this process and reused by every later cell on the same model); on CUDA ``mode="reduce-overhead"`` (CUDA
    graphs), on CPU inductor's default mode. Static caches are pooled per (model, slot, length): the k-th cache a
    sample makes on a model reuses the k-th buffer of the previous sample (:meth:`begin_sample`), so a compiled
    graph never sees a new cache object and CUDA graphs keep their static addresses.

    Args:
        max_len: positions of every static cache this execution makes (prompt cap + T + the largest padded
            forward); :meth:`resize` changes it between cells.

    Raises:
        RuntimeError: from :meth:`compiled_forward` if this torch has no ``torch.compile``.
    """

    def __init__(self, max_len: int = 512):
        self.max_len = max_len
        self._forwards: dict[int, Any] = {}
        _allow_every_bucket()
        self._pool: dict[tuple[int, int, int, str], Any] = {}
        self._slot: dict[tuple[int, str], int] = {}

    def resize(self, max_len: int) -> None:
        """Static caches made from now on hold ``max_len`` positions (a cell with a longer prompt cap or T)."""
        self.max_len = max_len

    def begin_sample(self) -> None:
        """A new generation starts: static caches are handed out from the first pooled slot again."""
        self._slot.clear()

    def compiled_forward(self, model: torch.nn.Module) -> Any:
        """``model.forward`` under ``torch.compile`` (made once per model)."""
        fn = self._forwards.get(id(model))
        if fn is None:
            mode = "reduce-overhead" if model.device.type == "cuda" else None
            fn = torch.compile(type(model).forward.__get__(model), mode=mode, dynamic=False)
            self._forwards[id(model)] = fn
        return fn

    def static_cache(self, model: torch.nn.Module, owner: str = "") -> Any:
        """The next pooled ``StaticCache`` of ``model`` for this sample (made on first use).

        ``owner`` keeps a separate pool: transformers' ``generate`` runs under ``no_grad``, and a cache whose buffers
        were made under dtbench's loops' ``inference_mode`` cannot be written outside it.
        """
        from transformers import StaticCache

        slot = self._slot.get((id(model), owner), 0)
        self._slot[(id(model), owner)] = slot + 1
        key = (id(model), slot, self.max_len, owner)
        cache = self._pool.get(key)
        if cache is None:
            cache = StaticCache(config=config_of(model), max_cache_len=self.max_len)
            self._pool[key] = cache
        return cache

    def precompile(
        self, models: list[torch.nn.Module], largest: int, sizes: tuple[int, ...] | None = None
    ) -> tuple[float, int]:
        """Compile every bucket up to ``largest`` new tokens (or the buckets of ``sizes`` only) for each model,
        outside any timed region.

        Each bucket's graph is compiled and run twice on a scratch static cache of the current length (on CUDA the
        second run records the CUDA graph), so the warmup and the measured samples reuse them.

        Returns:
            (seconds it took, graphs compiled: the number torch.compile reported, 0 when all were cached).
        """
        t0, graphs0 = time.perf_counter(), compiled_graphs()
        buckets = (
            sorted({bucket(n) or BUCKETS[-1] for n in sizes})
            if sizes is not None
            else [b for b in BUCKETS if b <= (bucket(largest) or BUCKETS[-1])]
        )
        with torch.inference_mode(), compiled(self):
            for model in models:
                self.begin_sample()
                cache = new_cache()
                forward(model, [0] * 4, cache)  # the prefill (eager) initialises the static buffers
                for b in buckets:
                    for _ in range(2):
                        crop(cache, 4)
                        forward(model, [0] * b, cache)
                self.begin_sample()
        if any(m.device.type == "cuda" for m in models):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, compiled_graphs() - graphs0


RECOMPILE_LIMIT = 512  # graphs per compiled function: every bucket of every model of a run (target and draft share one)


def _allow_every_bucket() -> None:
    """Raise dynamo's per-function graph limit (8 by default) so every bucket of every model compiles, and make
    hitting it an error: past the limit dynamo would silently run the forward eager, and a "compiled" cell would
    measure eager code (a cell of the embedded pair needs up to 9 buckets x 2 models of one class)."""
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(dynamo, name, RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
            setattr(dynamo, name, RECOMPILE_LIMIT)
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if getattr(dynamo, name, 4 * RECOMPILE_LIMIT) < 4 * RECOMPILE_LIMIT:
            setattr(dynamo, name, 4 * RECOMPILE_LIMIT)
    if hasattr(dynamo, "fail_on_recompile_limit_hit"):
        dynamo.fail_on_recompile_limit_hit = True


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's ``unique_graphs`` counter): a difference
    over a measured sample is its recompiles."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


_EXECUTION: contextvars.ContextVar[Execution | None] = contextvars.ContextVar("dtbench_execution", default=None)


@contextmanager
def compiled(execution: Execution) -> Iterator[Execution]:
    """Within this block every :func:`new_cache` is a :class:`StaticKV` of ``execution`` (compiled execution)."""
    token = _EXECUTION.set(execution)
    try:
        yield execution
    finally:
        _EXECUTION.reset(token)


def current() -> Execution | None:
    """The compiled execution this code runs in (inside :func:`compiled`), or None (eager)."""
    return _EXECUTION.get()


class StaticKV:
    """A KV cache for compiled execution: a preallocated ``StaticCache`` plus its logical length (a Python int).

    Slots ``[0, length)`` hold the committed positions; slots past them are stale (rejected drafts, bucket padding)
    and masked out of every later forward. It binds to a model at its first :func:`forward` (the prefill, eager).

    Raises:
        ValueError: a forward that would write past the static length (``Execution.max_len``).
    """

    def __init__(self, execution: Execution):
        self.execution = execution
        self.length = 0
        self.cache: Any = None
        self.model: torch.nn.Module | None = None

    def get_seq_length(self) -> int:
        """The logical length (positions held), as ``DynamicCache.get_seq_length``."""
        return self.length

    def _bind(self, model: torch.nn.Module) -> None:
        if self.model is None:
            self.model = model
            self.cache = self.execution.static_cache(model)
        elif self.model is not model:
            raise ValueError("a static KV cache serves one model")

    def forward(
        self,
        model: torch.nn.Module,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        last_only: bool,
    ) -> torch.Tensor:
        """:func:`forward` on this cache: (1, n) new tokens at slots ``[length, length + n)``; logits (n, vocab)
        (or (1, vocab) with ``last_only``). The first forward (the prefill) and forwards over the largest bucket run
        eager at their own size; the others are padded to their bucket and run the compiled forward."""
        self._bind(model)
        ex, L, n = self.execution, self.length, int(ids.shape[-1])
        nb = bucket(n) if L > 0 else None
        width = nb or n
        if L + width > ex.max_len:
            raise ValueError(f"static KV cache of {ex.max_len} positions is full ({L} held, {width} more fed)")
        dev = device_of(model)
        ids = ids.to(dev)
        pos = position_ids.to(dev) if position_ids is not None else torch.arange(L, L + n, device=dev).unsqueeze(0)
        slots = torch.arange(ex.max_len, device=dev)
        allowed = (slots < L).expand(width, ex.max_len).clone()  # every query sees the committed prefix
        if attention_mask is not None:
            given = attention_mask[0, 0].to(dev)
            allowed[:n, : L + n] = given if given.dtype == torch.bool else given == 0
        else:
            allowed[:n, L : L + n] = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
        if width > n:  # bucket padding: repeat the last token at the last position, attending to itself only
            ids = torch.cat([ids, ids[:, -1:].expand(1, width - n)], dim=1)
            pos = torch.cat([pos, pos[:, -1:].expand(1, width - n)], dim=1)
            pad = torch.arange(n, width, device=dev)
            allowed[pad, L + pad] = True
        from dtbench.decoders.tree.structure import attention_mask_kind

        if attention_mask_kind(model) == "bool":
            mask = allowed[None, None]
        else:
            dtype = dtype_of(model)
            mask = torch.zeros((1, 1, width, ex.max_len), dtype=dtype, device=dev).masked_fill_(
                ~allowed[None, None], torch.finfo(dtype).min
            )
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(L)
        kwargs: dict[str, Any] = {cache_keyword(model): self.cache}
        if nb is None and last_only:
            kwargs["logits_to_keep"] = 1
        if nb is None:
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **kwargs)
        else:
            # Through the module's __call__ (its forward hooks, e.g. the runner's forward counter, still fire),
            # with the instance's forward replaced by the compiled one for this call only.
            model.forward = ex.compiled_forward(model)
            try:
                out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **kwargs)
            finally:
                del model.forward
        self.length = L + n
        logits = out.logits[0]
        if nb is None:
            return logits
        return logits[n - 1 : n] if last_only else logits[:n]


KVCache = DynamicCache | StaticKV  # what new_cache makes: eager or compiled execution


def new_cache() -> KVCache:
    """An empty KV cache: a ``DynamicCache``, or a :class:`StaticKV` inside :func:`compiled`."""
    execution = _EXECUTION.get()
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
    """B sequences decoded together in one target: one right-padded ``DynamicCache`` with a length per row.

    Row r's committed positions are cache slots ``[0, lengths[r])``; the slots after them, up to the cache's width
    (the longest row), are padding that no query attends to. A forward feeds each row its own new tokens (ragged:
    n_r per row, padded to the longest) at slots ``[width, width + N)``, with per-row position ids
    (``lengths[r] + depth``) and a per-row 4D attention mask (the row's prefix, then the ancestor relation of its new
    tokens: causal for a chain, the tree mask of paper 3.4 for a tree). :meth:`keep` then moves each row's accepted
    entries right after its prefix and crops the padding, so every row keeps exactly its own accepted prefix (ragged
    acceptance, never cut to the shortest row); :meth:`retain` drops finished rows, which then cost no verification.

    The design follows the padded-batch verification of batched speculative decoding (BASS, Qian et al. 2024,
    "ragged" per-row lengths by masks and position ids) on transformers' 4D-mask path, the same path the one-row tree
    verification uses (:func:`dtbench.decoders.tree.structure.tree_attention_mask`).

    Args:
        model: a transformers causal LM whose attention takes an explicit 4D mask (sdpa or eager).

    Raises:
        ValueError: another attention implementation (it cannot take a per-row mask).
    """

    def __init__(self, model: torch.nn.Module):
        from dtbench.decoders.tree.structure import attention_mask_kind

        self.model = model
        self.kind = attention_mask_kind(model)
        self.cache = new_cache()
        self.lengths: list[int] = []
        self._width = 0  # cache width before the last forward (where its new tokens start)
        self._fed: list[int] = []  # new tokens per row in the last forward

    def _dynamic(self) -> DynamicCache:
        """The batch's cache, always a ``DynamicCache``: compiled execution (:class:`StaticKV`) runs at batch size 1
        only (the plan rejects batched compiled cells)."""
        assert isinstance(self.cache, DynamicCache), "a ragged batch runs eager"
        return self.cache

    @property
    def rows(self) -> int:
        """Rows currently in the batch."""
        return len(self.lengths)

    def prefill(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Feed every row's prompt in one forward (right-padded); each row's last-position logits, (vocab,) each."""
        self.lengths = [0] * len(prompts)
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
        b, width = len(tokens), cache_len(self.cache)
        n = max(len(t) for t in tokens)
        lengths = torch.tensor(self.lengths)
        aligned = ancestors is None and depths is None and all(len(t) == n for t in tokens)
        if aligned:  # every row a chain of n tokens (batched AR, equal drafts): one tensor op per input, no row loop
            ids = torch.tensor(tokens, dtype=torch.long)
            pos = lengths.unsqueeze(1) + torch.arange(n)
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
            pos[r, :m] = self.lengths[r] + (d.cpu() if d is not None else torch.arange(m))
            pos[r, m:] = self.lengths[r]
            a = ancestors[r] if ancestors is not None and ancestors[r] is not None else None
            new[r, :m, :m] = a.cpu() if a is not None else torch.ones(m, m, dtype=torch.bool).tril_()
        prefix = torch.arange(width) < lengths.unsqueeze(1)  # (b, width)
        allowed = torch.cat([prefix.unsqueeze(1).expand(b, n, width), new], dim=2).unsqueeze(1).to(dev)
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
        self._width, self._fed = width, [len(t) for t in tokens]
        return out.logits

    def keep(self, kept: list[list[int]]) -> None:
        """After :meth:`forward`: row r keeps its new tokens ``kept[r]`` (indices into its new tokens, increasing)
        right after its prefix; every other new entry and all padding past the longest row are dropped.

        Only the kept entries move (an in-place copy to lower slots); the cache is then cropped to the longest row.
        """
        width = self._width
        src_b, src_s, dst_s = [], [], []
        for r, idx in enumerate(kept):
            for i, u in enumerate(idx):
                if width + u != self.lengths[r] + i:
                    src_b.append(r)
                    src_s.append(width + u)
                    dst_s.append(self.lengths[r] + i)
            self.lengths[r] += len(idx)
        if src_b:
            rows = layers(self._dynamic())
            dev = rows[0].keys.device
            b_i = torch.tensor(src_b, device=dev)
            s_i, d_i = torch.tensor(src_s, device=dev), torch.tensor(dst_s, device=dev)
            for layer in rows:
                layer.keys[b_i, :, d_i] = layer.keys[b_i, :, s_i]
                layer.values[b_i, :, d_i] = layer.values[b_i, :, s_i]
        crop(self.cache, max(self.lengths, default=0))

    def retain(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the current rows, in order): finished rows leave the batch."""
        if rows == list(range(self.rows)):
            return
        self.lengths = [self.lengths[r] for r in rows]
        if not rows:
            self.cache = new_cache()
            return
        batch = layers(self._dynamic())
        dev = batch[0].keys.device
        sel = torch.tensor(rows, device=dev)
        for layer in batch:
            layer.keys = layer.keys.index_select(0, sel)
            layer.values = layer.values.index_select(0, sel)
        crop(self.cache, max(self.lengths))
