"""Lookahead decoding: a Jacobi window generates n-grams, a pool of them is verified, in one forward (Fu et al. 2024).

Paper: Fu, Bailis, Stoica, Zhang, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding"
(ICML 2024, arXiv 2402.02057). Reference read: hao-ai-lab/LookaheadDecoding, ``lade/decoding.py``
(``jacobi_greedy_search_multilevel``, ``update_token_map``: the pool and its LRU cap, ``fill_pool_with_prompt``)
and ``lade/models/llama.py`` (``j_make_causal_mask_multilevel``: the attention mask of both branches).

Each iteration feeds one target forward holding two branches after the pending token (the root, position P):

- the *verification branch*: up to G n-grams from the pool whose first token is the root (their other N - 1
  tokens), verified greedily. dtbench merges them into a trie under the root (shared prefixes fed once; greedy
  acceptance is the same as verifying them as separate chains, as the reference does) and verifies it as the
  one tree loop verifies any tree (:func:`~dtbench.decoders.tree.speculate_tree`);
- the *lookahead branch*: the W x (N - 1) Jacobi window, fed as a :class:`~dtbench.decoders.tree.structure.
  SideBranch` (seen by no verified token, dropped from the cache afterwards). Level 0 is ``[root] + W - 1``
  tokens at positions P..P+W-1; level l >= 1 holds W tokens, token i at position P + l + i. Token (l, i) attends
  to the prefix, to level 0 up to its own column (root and level-0 tokens 0..i-1 for l >= 1, causal within level
  0) and to token i of levels 1..l (the reference's mask). The target's greedy token after (N - 2, i) is the new
  level's token i; column i, ``(level0[i], level1[i], ..., level_{N-2}[i], new[i])`` (level 0 with the root in
  front), is an n-gram for the pool, keyed by its first token. Then the window slides one position (the
  reference's ``ALWAYS_FWD_ONE``): level 0 <- level 1 without its first token, level l <- level l + 1, the last
  level <- the new tokens. For its first N - 2 iterations the window fills level by level and yields no n-gram.

The pool keeps at most G n-grams per key, least recently produced first out (the reference's ``GUESS_SET_SIZE``
LRU). ``pool_from_prompt`` (the reference's ``POOL_FROM_PROMPT``, off by default) also puts every n-gram of the
prompt and of the output into the pool. The window's initial level 0 is drawn from the prompt's tokens (the
reference's ``copy_from``) with a Python RNG seeded by ``seed``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import torch
from pydantic import Field

from dtbench.decoders.base import Decoder, DecoderParams, Step
from dtbench.decoders.tree import TreeDrafter, speculate_tree
from dtbench.decoders.tree.structure import CacheStrategy, SideBranch, TokenTree


class NgramPool:
    """n-grams keyed by their first token, at most ``cap`` per key, least recently added first out.

    Attributes:
        entries: first token -> ordered set (an OrderedDict with None values) of the n - 1 following tokens.
    """

    def __init__(self, cap: int):
        self.cap = cap
        self.entries: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        """Insert (or refresh) one n-gram ``(key, *continuation)``, evicting the key's oldest beyond the cap."""
        bucket = self.entries.setdefault(key, OrderedDict())
        if continuation in bucket:
            bucket.move_to_end(continuation)
            return
        bucket[continuation] = None
        if len(bucket) > self.cap:
            bucket.popitem(last=False)

    def add_text(self, tokens: list[int], n: int) -> None:
        """Insert every n-gram of ``tokens`` (``fill_pool_with_prompt``)."""
        for s in range(len(tokens) - n + 1):
            self.add(tokens[s], tuple(tokens[s + 1 : s + n]))

    def candidates(self, key: int) -> list[tuple[int, ...]]:
        """The continuations stored under ``key``, oldest first."""
        return list(self.entries.get(key, ()))

    @property
    def ngrams(self) -> int:
        """n-grams held."""
        return sum(len(b) for b in self.entries.values())


class LookaheadDrafter(TreeDrafter):
    """The Jacobi window (a side branch of every verify forward) and the pool trie it drafts (see the module).

    Attributes:
        levels: the window; ``levels[0]`` W - 1 tokens (the root precedes them), the others W tokens each.
        pool: the :class:`NgramPool`.
    """

    def __init__(self, prompt: list[int], window: int, ngram: int, guess: int, pool_from_prompt: bool, seed: int):
        """Args: prompt: the prompt's token ids (>= 1); window: W >= 2; ngram: N >= 2; guess: G >= 1;
        pool_from_prompt, seed: see :class:`LookaheadParams`."""
        self.w, self.n = window, ngram
        rng = random.Random(seed)
        self.levels: list[list[int]] = [[rng.choice(prompt) for _ in range(window - 1)]]
        self.pool = NgramPool(guess)
        self.pool_from_prompt = pool_from_prompt
        self.history = list(prompt[-(ngram - 1) :]) if ngram > 1 else []
        if pool_from_prompt:
            self.pool.add_text(list(prompt), ngram)
        self.max_breadth = guess
        self._layouts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.n_max = guess * (ngram - 1)
        self.depth_limit = ngram - 1

    def draft(self, tree: TokenTree, root: int, depth_cap: int) -> None:
        """The trie of the pool's continuations of ``root`` (each cut to ``depth_cap`` tokens), level by level."""
        trie: dict[tuple[int, ...], int] = {(): 0}  # token path -> tree node
        for d in range(1, depth_cap + 1):
            level = []
            for cont in self.pool.candidates(root):
                if len(cont) >= d and cont[:d] not in trie and cont[:d] not in level:
                    level.append(cont[:d])
            level = level[: tree.budget_left]
            if not level:
                break
            parents = torch.tensor([trie[p[:-1]] for p in level], device=tree.device)
            tokens = torch.tensor([p[-1] for p in level], device=tree.device)
            zeros = torch.zeros(len(level), dtype=torch.float32, device=tree.device)
            trie.update(zip(level, tree.add(parents, tokens, zeros, zeros, d)))

    def side_branch(self) -> SideBranch:
        """The window as side tokens: level 0, then levels 1.. in order (positions and mask: module docstring)."""
        if len(self.levels) not in self._layouts:  # one layout per fill level: computed once per drafter
            self._layouts[len(self.levels)] = self._layout(len(self.levels))
        offsets, attends = self._layouts[len(self.levels)]
        return SideBranch(torch.tensor([t for level in self.levels for t in level]), offsets, attends)

    def _layout(self, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets (m,), attends (m, m)) of a window with ``levels`` levels (they depend on nothing else)."""
        w = self.w
        offsets = list(range(1, w))
        for lv in range(1, levels):
            offsets += [lv + i for i in range(w)]
        m = len(offsets)
        attends = torch.zeros((m, m), dtype=torch.bool)
        level0 = torch.arange(w - 1)
        attends[: w - 1, : w - 1] = level0.unsqueeze(1) >= level0.unsqueeze(0)  # causal within level 0
        for lv in range(1, levels):
            for i in range(w):
                row = w - 1 + (lv - 1) * w + i
                attends[row, :i] = True  # level-0 tokens 0..i-1 (the root, column -1, is always seen)
                for m_lv in range(1, lv + 1):
                    attends[row, w - 1 + (m_lv - 1) * w + i] = True
        return torch.tensor(offsets), attends

    def feed_logits(self, tree: TokenTree, logits: torch.Tensor, side_logits: torch.Tensor | None) -> None:
        """New window level from the greedy tokens of the last level; n-grams into the pool; slide the window."""
        w = self.w
        if self.pool_from_prompt:
            self.history.append(int(tree.tokens[0]))
        assert side_logits is not None  # side_branch always feeds the window
        if len(self.levels) == 1:  # the last level is level 0: its rows are the root's and level 0's
            new = [int(torch.argmax(logits[0]))] + torch.argmax(side_logits[: w - 1], dim=-1).tolist()
        else:
            new = torch.argmax(side_logits[-w:], dim=-1).tolist()
        if len(self.levels) < self.n - 1:  # still filling the window
            self.levels.append(new)
            return
        column0 = [int(tree.tokens[0]), *self.levels[0]]
        for i in range(w):
            self.pool.add(column0[i], tuple(level[i] for level in self.levels[1:]) + (new[i],))
        window = [*self.levels, new]
        self.levels = [window[1][1:], *window[2:]]

    def observe(self, step: Step) -> None:
        """With ``pool_from_prompt``, the output's n-grams join the pool as they are committed."""
        if self.pool_from_prompt:  # the last committed token is the next root, added by feed_logits
            self.history.extend(step.tokens[:-1])
            self.pool.add_text(self.history, self.n)
            self.history = self.history[-(self.n - 1) :]


class LookaheadParams(DecoderParams):
    """Hyperparameters of ``lookahead``; defaults: the paper's for 7B models on an A100 (W=15, N=5, G=15).

    Attributes:
        window_size: W, the Jacobi window's width (reference ``WINDOW_SIZE``).
        ngram_size: N, tokens per n-gram; the window has N - 1 levels (reference ``LEVEL``).
        guess_set_size: G, most n-grams kept per first token and verified per iteration (``GUESS_SET_SIZE``).
        pool_from_prompt: also pool the prompt's and the output's n-grams (``POOL_FROM_PROMPT``; off in the paper).
        seed: seeds the draw of the window's first level from the prompt's tokens.
        cache_strategy: the tree loop's target cache update (see :class:`~dtbench.decoders.tree.TreeParams`).
    """

    window_size: int = Field(15, ge=2, le=256, description="W: Jacobi window width (lookahead positions)")
    ngram_size: int = Field(5, ge=2, le=16, description="N: n-gram size (the window has N - 1 levels)")
    guess_set_size: int = Field(15, ge=1, le=256, description="G: n-grams kept per first token and verified")
    pool_from_prompt: bool = Field(False, description="also pool the prompt's and output's n-grams")
    seed: int = Field(0, ge=0, description="seed of the window's initial tokens (drawn from the prompt)")
    cache_strategy: CacheStrategy = Field("compact", description="'compact' (1 target forward) or 'rebuild'")


class Lookahead(Decoder):
    """Lookahead decoding (Fu et al. 2024) on the one tree loop: the pool's n-grams as a verified trie, the Jacobi
    window as a side branch of the same forward; lossless (greedy verification).

    Capabilities: family ``tree``; verify sizes (0 chain tokens; root + G (N - 1) pool tokens + the window's
    (W - 1) + (N - 2) W tokens, all masked); no draft model; no sampling (a suite that samples is refused at
    validation; the reference's sampled acceptance is not implemented). State recorded per sample:
    ``pool_ngrams`` and ``pool_tokens`` (n-grams held, N tokens each) and ``window_tokens``.
    """

    Params = LookaheadParams
    family = "tree"
    needs_draft = False
    lossless = True
    supports_sampling = False
    version = "1"

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """A small window (W = 4, N = 3, G = 4): pool hits within the checked lengths."""
        return [{"window_size": 4, "ngram_size": 3, "guess_set_size": 4}]

    def __init__(self, target, draft, params: LookaheadParams):
        super().__init__(target, None, params)
        self.drafter: LookaheadDrafter | None = None

    @classmethod
    def verify_sizes(cls, params: LookaheadParams) -> tuple[int, int]:
        """(chain tokens, masked tokens) of one verification with a full pool and a filled window."""
        w, n, g = params.window_size, params.ngram_size, params.guess_set_size
        return 0, 1 + g * (n - 1) + (w - 1) + (n - 2) * w

    @classmethod
    def reference(cls, params: LookaheadParams | None = None):
        return ("ar", {})

    def state_stats(self) -> dict[str, int] | None:
        if self.drafter is None:
            return None
        ngrams = self.drafter.pool.ngrams
        return {
            "pool_ngrams": ngrams,
            "pool_tokens": ngrams * self.params.ngram_size,
            "window_tokens": sum(len(level) for level in self.drafter.levels),
        }

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int):
        """Run :func:`~dtbench.decoders.tree.speculate_tree` with a fresh :class:`LookaheadDrafter`."""
        p = self.params
        self.drafter = LookaheadDrafter(
            input_ids[0].tolist(), p.window_size, p.ngram_size, p.guess_set_size, p.pool_from_prompt, p.seed
        )
        yield from speculate_tree(
            self.target,
            None,
            input_ids,
            max_new_tokens,
            self.drafter,
            p.cache_strategy,
            tree_root="pending",
            eos_token_id=self.eos_token_id,
        )


__all__ = ["Lookahead", "LookaheadDrafter", "LookaheadParams", "NgramPool"]
