"""The StreamingLLM cache (:class:`StreamingKV`): attention sinks + a recent window, exact under speculation.

Used by the decoders in :mod:`dtbench.decoders.streaming` (paper section 4.3, Table 1).

StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks", sections 3.2-3.3)
keeps the key/value entries of the first ``S`` tokens (the *attention sinks*) and of the most recent tokens and
evicts everything in between. Positions are assigned *within the cache* (section 3.3): a query and the keys it
attends to get RoPE positions equal to their ranks in the cache, not their positions in the original text, so
after an eviction the sinks sit directly before the window in position space.

The policy, exactly (the same for every token, prompt or generated, in both decoders):

* Token ``u`` (0-based index in the whole sequence, prompt included) attends to the sinks ``{0 .. S-1}`` and to
  the ``R`` most recent tokens ``{u-R+1 .. u}`` (itself included); no other earlier token. While ``u < S + R``
  this is plain causal attention.
* The RoPE offset between query ``u`` and a visible key ``v`` is the difference of their ranks in that visible
  set: the true distance ``u - v`` for window keys, ``S + min(R, u - S + 1) - 1 - j`` for sink ``j``.
* Between steps a cache holds at most ``S + R`` entries (``S`` sinks and a window of at most ``R``).

Implementation. RoPE attention scores depend only on the *difference* of the query's and the key's positions
(``<R(m) q, R(n) k> = <q, R(n - m) k>``), so "positions are cache indices" is kept up to a global offset
``base``: the key at physical cache index ``i`` is stored rotated to position ``base + i``. Evicting ``e`` window
entries therefore leaves the window keys as they are and only moves the ``S`` sink keys, re-rotated to
``base + e + j`` with the rotate_half formula and the cos/sin of the shift. (transformers' removed ``SinkCache``
re-rotated the whole window on every eviction; here the work is O(S) per layer, and no rounding accumulates
because the sinks are re-derived each time from a pristine copy taken at position 0.) The sinks are written into
the slots just before the kept window and the cache becomes a view from there, so no full-cache copy is made.
When ``base`` reaches ``S + R`` the whole cache is re-rotated back to ``base = 0`` (an O(S + R) copy once per
``S + R`` evicted tokens), so RoPE positions stay below ``2 (S + R) + K + 1`` however long the stream, as in
StreamingLLM.

Speculation that equals streaming AR exactly. Verifying ``pending`` and ``K`` drafts (tokens ``u0 .. u0+K``) in
one target forward, query ``u0 + k`` must see the same keys, at the same RoPE offsets, as streaming AR gives it.
Before the forward the window is evicted down to the ``R - 1`` tokens before ``u0`` (exactly what AR evicts
before processing ``u0``). Query ``u0 + k`` must additionally *not* see the oldest ``k`` of those (AR would have
evicted them by then) and must see the sinks ``k`` positions further on (``k`` more evictions would have moved
them in AR). One forward cannot give a key two positions, so for each ``k >= 1`` the forward carries a *copy* of
the ``S`` sink keys rotated by ``+k`` (same values), and a 4D attention mask lets query ``k`` see: its own sink
copy (the sinks themselves for ``k = 0``), window entries ``k .. R-2``, and new tokens ``0 .. k``. The new tokens
get position ids ``base + S + (R - 1) + k``, the positions AR gives them. So each committed token's logits are
computed from exactly the key/value set, at exactly the RoPE offsets, that streaming AR computes them from; by
induction over tokens and layers the cached keys and values are the same too, and the greedy outputs agree
token for token (up to floating-point summation order, as for any batched verification; the sink keys used for
a given token are even computed by the same rotation of the same pristine copy in both). Rejected drafts sit at
the tail and are cropped; the cache is then trimmed to ``S + R`` entries. After the forward the sink copies are
removed by moving the ``K + 1`` new entries down over them (O(K), no full-cache copy). Why not simply evict
before verifying so that ``K + 1`` new tokens fit in ``S + R``? Then the first drafted positions would see fewer
window tokens than AR does, and the outputs would differ whenever eviction is active.

Transient sizes and splits: during one verification the target cache holds up to ``S + (R - 1) + S K + K + 1``
entries. A forward never holds more than ``R`` new tokens with the masked scheme (a longer verification, K >= R,
is split, and later pieces hide rather than evict entries a rollback may need); a forward that crosses token
index ``S + R`` is split there, since the sinks must exist before they are copied (once per generation). Each
split costs one more target forward (the runner's forward counter sees it). The prompt follows the same policy:
its first ``S + R`` tokens in one plain causal forward (identical to ``ar``'s prefill when the prompt fits), the
rest in masked chunks of at most ``min(R, 256)`` tokens, so prompts longer than ``S + R`` are streamed exactly.

The draft model follows the same policy between iterations: committed tokens are fed to it exactly as above, and
its cache is trimmed to ``S + R`` entries after each iteration. Within one drafting round it does not evict: its
tentative drafts attend to up to ``K - 1`` more window tokens, so rejected drafts can be rolled back by a crop.
This changes only which tokens are proposed, never the output.

Supported: models whose attention applies rotate_half RoPE to the keys before caching and whose only position
information is RoPE: ``LlamaForCausalLM`` (including the embedded SmolLM2) and ``GPTNeoXForCausalLM`` (the
paper's Pythia models; partial rotary), with RoPE types whose angle is ``position * inv_freq`` ("default",
"linear", "llama3"), under the ``sdpa`` (boolean mask) or ``eager`` (additive mask) attention implementation.
Anything else raises ValueError when the decoder is constructed.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import DynamicCache

from dtbench.decoders import kv, modelinfo

SUPPORTED_MODEL_TYPES = ("llama", "gpt_neox")
"""``config.model_type`` values whose attention caches rotate_half-RoPE keys of shape (1, kv_heads, seq, head_dim)."""

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE variants whose rotation angle is ``position * inv_freq`` with a fixed ``inv_freq`` (purely relative)."""

SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations that accept a custom 4D mask (boolean for sdpa, additive float for eager)."""

PREFILL_CHUNK = 256
"""Largest number of prompt tokens beyond the first ``S + R`` fed in one masked forward."""


class Rope:
    """The rotary embedding of one model, for re-rotating cached keys by a position shift.

    Attributes:
        inv_freq: inverse frequencies, shape (rotary_dim / 2,), float64 (the float32 values transformers uses),
            on the model's device.
        rotary_dim: number of leading head dimensions RoPE rotates (head_dim for Llama, ``rotary_pct * head_dim``
            for GPT-NeoX); the rest pass through unchanged.
    """

    def __init__(self, model: torch.nn.Module):
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"StreamingLLM decoders support model types {SUPPORTED_MODEL_TYPES} (rotate_half RoPE applied before "
                f"caching), not {model_type!r} ({type(model).__name__})"
            )
        attn = getattr(config, "_attn_implementation", None) or "eager"
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"StreamingLLM decoders need a custom 4D attention mask, which attention implementation {attn!r} "
                f"cannot take; load the model with attn_implementation in {SUPPORTED_ATTENTION}"
            )
        self.mask_is_bool = attn == "sdpa"
        rotaries = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "rope_type")]
        if len(rotaries) != 1:
            raise ValueError(
                f"expected exactly one rotary embedding module in {type(model).__name__}, found {len(rotaries)}"
            )
        rotary = rotaries[0]
        if rotary.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"RoPE type {rotary.rope_type!r} is not purely relative (its angles depend on the sequence length); "
                f"StreamingLLM decoders support {SUPPORTED_ROPE_TYPES}"
            )
        self.inv_freq = (
            cast(torch.Tensor, rotary.inv_freq).detach().float().double()
        )  # the float32 values transformers multiplies
        self.rotary_dim = 2 * self.inv_freq.numel()

    def rotate(self, keys: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
        """Keys rotated by ``shift`` more positions (RoPE composes additively: R(a) R(b) = R(a + b)).

        Args:
            keys: shape (batch, kv_heads, n, head_dim), any float dtype, already rotated to some positions.
            shift: a position shift (int, may be negative), or an int64 tensor broadcastable to (n,) with one
                shift per entry.

        Returns:
            A new tensor, same shape and dtype: ``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim``
            dimensions with cos/sin of ``shift * inv_freq``, computed in float32 (float64 for float64 keys).
        """
        compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
        inv_freq = self.inv_freq.to(keys.device)
        if torch.is_tensor(shift):
            freqs = shift.to(torch.float64)[:, None] * inv_freq[None, :]  # (n, rotary_dim / 2)
        else:
            freqs = (inv_freq * float(shift))[None, :]  # a Python scalar: no host-to-device copy
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(compute), emb.sin().to(compute)
        rd = self.rotary_dim
        x = keys[..., :rd].to(compute)
        half = rd // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        out = (x * cos + rotated * sin).to(keys.dtype)
        if rd < keys.shape[-1]:
            out = torch.cat((out, keys[..., rd:]), dim=-1)
        return out


class StreamingKV:
    """A model's KV cache under the StreamingLLM policy of this module's docstring (sinks + recent window).

    The cache is a transformers ``DynamicCache`` whose layers hold keys/values of shape
    (1, kv_heads, seq, head_dim) in the model's dtype; entry ``i`` is stored rotated to RoPE position ``base + i``.
    Layout between calls: ``[sinks (min(S, n)) | window (contiguous, the most recent tokens)]``.

    Attributes:
        model: the causal LM.
        sinks: S, number of attention-sink tokens kept (>= 0).
        window: R, number of most recent tokens each query attends to, itself included (>= 1).
        cache: the ``DynamicCache``.
        n: number of sequence tokens whose keys/values have been computed into the cache (evicted ones included).
        base: RoPE position of physical cache index 0.

    Raises:
        ValueError: (constructor) if the model's architecture, RoPE type or attention implementation is not
            supported (see the module docstring).
    """

    def __init__(self, model: torch.nn.Module, sinks: int, window: int):
        self.model = model
        self.rope = Rope(model)
        self.sinks = sinks
        self.window = window
        self.cache = DynamicCache()
        self.n = 0
        self.base = 0
        self._sink_keys: torch.Tensor | None = None  # (layers, 1, kv_heads, S, head_dim), positions 0..S-1
        self._sink_values: torch.Tensor | None = None

    # -- sizes ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Physical number of cache entries (tokens)."""
        return kv.cache_len(self.cache)

    @property
    def held_sinks(self) -> int:
        """Sink entries present (S once the sequence has S tokens)."""
        return min(self.sinks, self.n)

    @property
    def window_len(self) -> int:
        """Non-sink entries present; they are the most recent ``window_len`` tokens."""
        return len(self) - self.held_sinks

    # -- forward ----------------------------------------------------------------------------------------------
    def forward(
        self, token_ids: list[int], *, exact: bool = True, tentative: bool = False, last_only: bool = False
    ) -> tuple[torch.Tensor, int]:
        """Run the model on new tokens appended to the sequence, updating the cache.

        Args:
            token_ids: the new tokens (n >= 1 ints).
            exact: apply the StreamingLLM policy exactly (evicting and masking as needed). False appends the tokens
                with plain causal attention over the whole current cache and no eviction (the draft's tentative
                tokens, which may be cropped again).
            tentative: the new tokens may be cropped afterwards (a verification): when the call needs several
                forwards, later ones hide (with the mask) instead of evicting the new entries and the R - 1
                entries before them, which a rollback may need again.
            last_only: return logits for the last new token only (saves the LM head over a prompt).

        Returns:
            (logits of shape (n, vocab), or (1, vocab) with ``last_only``, in the model's dtype;
            number of model forwards run).
        """
        if not exact:
            return self._plain(token_ids, last_only), 1
        total = len(token_ids)
        pieces: list[torch.Tensor] = []
        # Tokens with index < S + R never hide anything (nothing was ever evicted): plain causal attention.
        start = min(total, max(0, self.sinks + self.window - self.n))
        if start:
            pieces.append(self._plain(token_ids[:start], last_only and start == total))
        chunk = max(1, min(self.window, PREFILL_CHUNK))
        while start < total:
            end = min(total, start + chunk)
            keep = start + self.window - 1 if tentative else 0  # rollback may need them all
            pieces.append(self._masked(token_ids[start:end], keep, last_only and end == total))
            start = end
        if last_only:
            return pieces[-1][-1:], len(pieces)
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)), len(pieces)

    def _positions(self, start: int, n: int) -> torch.Tensor:
        """Position ids, shape (1, n) int64 on the model's device: ``start .. start + n - 1``."""
        return torch.arange(start, start + n, dtype=torch.long, device=modelinfo.device_of(self.model))[None, :]

    def _plain(self, token_ids: list[int], last_only: bool) -> torch.Tensor:
        """Append tokens with plain causal attention over the whole cache, at positions base + physical index."""
        positions = self._positions(self.base + len(self), len(token_ids))
        logits = kv.forward(self.model, token_ids, self.cache, position_ids=positions, last_only=last_only)
        self.n += len(token_ids)
        self._capture_sinks()
        return logits

    def _masked(self, token_ids: list[int], keep: int, last_only: bool) -> torch.Tensor:
        """Append 1 <= m <= R tokens, all with sequence index >= S + R, exactly under the policy.

        Evicts down to the R - 1 tokens before the first new one (but keeps at least ``keep`` window entries); new
        token k then hides the ``h_k = w - (R - 1) + k`` oldest window entries and sees the sinks rotated by h_k
        more positions (a rotated copy when h_k > 0; module docstring).
        """
        S, R = self.sinks, self.window
        self.evict_to(max(R - 1, keep))
        m = len(token_ids)
        w = self.window_len
        h0 = w - (R - 1)  # entries the first new token must not see
        assert h0 >= 0 and self.held_sinks == S and m <= R, (w, S, m)
        if m == 1 and h0 == 0:
            return self._plain(token_ids, last_only)
        first = max(h0, 1)  # sink copies for shifts first .. h0 + m - 1 (shift 0 uses the sinks themselves)
        n_copies = h0 + m - first
        copies = S * n_copies
        if copies:
            sink_keys, sink_values = self._sinks()
            shifts = (
                torch.arange(first, h0 + m, device=modelinfo.device_of(self.model)) + self.base
            ).repeat_interleave(S)
            k_copies = self.rope.rotate(sink_keys.repeat(1, 1, 1, n_copies, 1), shifts)
            v_copies = sink_values.repeat(1, 1, 1, n_copies, 1)
            for i, layer in enumerate(modelinfo.layers(self.cache)):
                layer.keys = torch.cat((layer.keys, k_copies[i]), dim=-2)
                layer.values = torch.cat((layer.values, v_copies[i]), dim=-2)
        mask = self._mask(w, m, h0, first)
        positions = self._positions(self.base + S + w, m)
        logits = kv.forward(
            self.model, token_ids, self.cache, position_ids=positions, attention_mask=mask, last_only=last_only
        )
        if copies:  # move the m new entries down over the copies: O(m), the window is not touched
            lo = S + w
            for layer in modelinfo.layers(self.cache):
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    t[..., lo : lo + m, :] = t[..., lo + copies :, :].clone()
                    setattr(layer, name, t[..., : lo + m, :])
        self.n += m
        return logits

    def _mask(self, w: int, m: int, h0: int, first: int) -> torch.Tensor:
        """The 4D mask, shape (1, 1, m, S + w + S*(h0 + m - first) + m), of a masked forward.

        Boolean (True = attend) for sdpa, additive (0 or the dtype's minimum, model dtype) for eager. Query k,
        hiding h = h0 + k window entries, sees the sinks if h == 0, else the sink copy of shift h (copies are laid
        out by shift, ``first`` first); window entries h .. w-1; new tokens 0 .. k.
        """
        S = self.sinks
        device = modelinfo.device_of(self.model)
        h = torch.arange(h0, h0 + m, device=device)[:, None]
        allowed = torch.cat(
            (
                (h == 0).expand(m, S),
                torch.arange(w, device=device)[None, :] >= h,
                torch.arange(S * (h0 + m - first), device=device)[None, :] // max(S, 1) + first == h,
                torch.arange(m, device=device)[None, :] <= h - h0,
            ),
            dim=1,
        )[None, None]
        if self.rope.mask_is_bool:
            return allowed
        dtype = modelinfo.dtype_of(self.model)
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)

    # -- cache edits ------------------------------------------------------------------------------------------
    def _capture_sinks(self) -> None:
        """Keep pristine copies of the sink keys (rotated to positions 0..S-1) and values once all S exist.

        ``_sink_keys`` / ``_sink_values``: shape (layers, 1, kv_heads, S, head_dim), the model's dtype.
        """
        if self._sink_keys is None and self.sinks and self.n >= self.sinks:
            assert self.base == 0
            S = self.sinks
            self._sink_keys = torch.stack([layer.keys[..., :S, :] for layer in modelinfo.layers(self.cache)])
            self._sink_values = torch.stack([layer.values[..., :S, :] for layer in modelinfo.layers(self.cache)])

    def _sinks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pristine sink keys and values; captured (:meth:`_capture_sinks`) once the sequence holds S > 0
        tokens, which every caller has checked (held sinks)."""
        assert self._sink_keys is not None and self._sink_values is not None, "the sinks are captured once S exist"
        return self._sink_keys, self._sink_values

    def evict_to(self, max_window: int) -> None:
        """Evict the oldest window entries so that at most ``max_window`` remain; sinks are kept.

        The sinks are written into the slots just before the kept window, re-rotated from their pristine copy to
        positions ``base + e + j``, and the cache becomes a view from there: O(S) work per layer, the window is
        not touched. When ``base`` would reach S + R the cache is rebased instead (every key re-rotated so that
        ``base`` is 0 again, one O(S + R) copy per S + R evicted tokens).
        """
        e = self.window_len - max_window
        if e <= 0:
            return
        S = self.held_sinks
        new_base = self.base + e
        if new_base >= self.sinks + self.window:
            for i, layer in enumerate(modelinfo.layers(self.cache)):
                kept = self.rope.rotate(layer.keys[..., S + e :, :], -new_base)
                if S:
                    sink_keys, sink_values = self._sinks()
                    layer.keys = torch.cat((sink_keys[i], kept), dim=-2)
                    layer.values = torch.cat((sink_values[i], layer.values[..., S + e :, :]), dim=-2)
                else:
                    layer.keys, layer.values = kept, layer.values[..., e:, :]
            self.base = 0
            return
        if S:
            pristine_keys, sink_values = self._sinks()
            sink_keys = self.rope.rotate(pristine_keys, new_base)
            for i, layer in enumerate(modelinfo.layers(self.cache)):
                layer.keys[..., e : e + S, :] = sink_keys[i]
                layer.values[..., e : e + S, :] = sink_values[i]
        for layer in modelinfo.layers(self.cache):
            layer.keys = layer.keys[..., e:, :]
            layer.values = layer.values[..., e:, :]
        self.base = new_base

    def enforce_budget(self) -> None:
        """Trim to the between-steps budget: at most S + R entries (a window of at most R)."""
        self.evict_to(self.window)

    def crop(self, n_keep: int) -> None:
        """Drop the newest ``self.n - n_keep`` entries (tentative tokens appended since the last trim).

        Raises:
            ValueError: if those entries are no longer all in the cache (some were evicted) or ``n_keep > n``.
        """
        drop = self.n - n_keep
        evicted = self.n != len(self)
        if drop < 0 or drop > len(self) or (evicted and drop > self.window_len):
            raise ValueError(f"cannot crop a streaming cache of {self.n} tokens ({len(self)} held) to {n_keep}")
        if drop:
            kv.crop(self.cache, len(self) - drop)
            self.n = n_keep
            if self.n < self.sinks:
                self._sink_keys = self._sink_values = None
