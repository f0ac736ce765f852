"""Test-only companions of the random drafting heads: a deeper Llama for EAGLE-3 and an oracle drafter.

The heads themselves (Medusa-1, EAGLE-1/2/3 in their published file formats) are written by
:func:`dtbench.testing.fixtures.write_medusa` and :func:`~dtbench.testing.fixtures.write_eagle`.
"""

from __future__ import annotations

import torch

from dtbench.decoders.tree import TreeDrafter


def deep_llama(seed: int, layers: int = 8, sharpness: float = 32.0) -> torch.nn.Module:
    """A float64 Llama like ``testkit.tiny_llama`` (vocab 96, hidden 32) but ``layers`` deep: EAGLE-3 reads target
    layers 2, L // 2 and L - 3, which need L >= 7."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpness)
    return model


class Oracle(TreeDrafter):
    """Test-only: wraps a real drafter and, on some iterations, overwrites the tokens of one root-to-leaf chain of
    its tree with the target's true greedy continuation (known in advance), so multi-token acceptances and deeper
    tree paths occur with random heads. Plants ``plant[i % len(plant)]`` tokens at iteration i (0: none), down
    the first child of each node, or down the last child on odd iterations when ``last_child`` (a branch other
    than the most probable one). ``log`` records (planted tokens, whether a non-first child was planted) per
    drafted tree."""

    def __init__(
        self, inner: TreeDrafter, greedy: list[int], plant: tuple[int, ...] = (3, 0, 1, 5, 2), last_child: bool = False
    ):
        self.inner, self.greedy, self.plant, self.last_child = inner, greedy, plant, last_child
        self.hidden_layers, self.max_breadth = inner.hidden_layers, inner.max_breadth
        self.n_max, self.depth_limit = inner.n_max, inner.depth_limit
        self.committed = 0
        self.iteration = 0
        self.planted = 0
        self.log: list[tuple[int, bool]] = []

    def feed_target(self, features, next_tokens):
        self.committed += 1 if self.committed == 0 else len(next_tokens)
        self.inner.feed_target(features, next_tokens)

    def draft(self, tree, root, depth_cap):
        self.inner.draft(tree, root, depth_cap)
        k = self.plant[self.iteration % len(self.plant)]
        last = self.last_child and self.iteration % 2 == 1
        self.iteration += 1
        node, planted, side = 0, 0, False
        for d in range(k):
            kids = [u for u in range(1, tree.size) if int(tree.parents[u]) == node]
            pos = self.committed + d
            if not kids or pos >= len(self.greedy):
                break
            node = kids[-1] if last else kids[0]
            side |= len(kids) > 1 and last
            tree.tokens[node] = self.greedy[pos]
            planted += 1
        self.planted += planted
        self.log.append((planted, side))
