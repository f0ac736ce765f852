"""Tiny random drafting heads written in the published file formats, and a test-only oracle drafter.

Layouts mirrored (read in the reference repositories):
- Medusa-1 (FasterDecoding/Medusa medusa/model/medusa_model.py): config.json with medusa_num_heads and
  medusa_num_layers; medusa_lm_head.pt = state dict of the ModuleList of heads, keys {i}.{j}.linear.weight,
  {i}.{j}.linear.bias, {i}.{medusa_num_layers}.weight.
- EAGLE-1/2 (SafeAILab/EAGLE eagle/model/cnets1.py): config.json (LlamaConfig fields, "bias"),
  pytorch_model.bin with embed_tokens.weight, fc.weight, fc.bias, layers.0.self_attn.{q,k,v,o}_proj.weight,
  layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight (no input_layernorm at index 0).
- EAGLE-3 (SafeAILab/EAGLE eagle/model/cnets.py): config.json with draft_vocab_size; model.safetensors with
  fc.weight (no bias), midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
  midlayer.self_attn.{q,k,v}_proj.weight over 2h, midlayer.self_attn.o_proj.weight, midlayer.mlp.*, norm.weight,
  lm_head.weight (draft_vocab_size rows), d2t (int64), t2d (bool); embed_tokens.weight optional (``embedding``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dtbench.decoders.tree import TreeDrafter


def write_medusa(
    folder: Path, *, hidden: int, vocab: int, heads: int = 4, layers: int = 1, seed: int = 0, scale: float = 1.0
) -> Path:
    """A Medusa-1 head folder: config.json + medusa_lm_head.pt with the published keys (random weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(heads):
        for j in range(layers):
            sd[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=gen) * 0.1
            sd[f"{i}.{j}.linear.bias"] = torch.zeros(hidden)
        sd[f"{i}.{layers}.weight"] = torch.randn(vocab, hidden, generator=gen) * scale
    torch.save(sd, folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(
        json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny-llama"})
    )
    return folder


def _llama_fields(hidden: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }


def write_eagle(
    folder: Path,
    *,
    hidden: int,
    vocab: int,
    version: int = 1,
    draft_vocab: int | None = None,
    seed: int = 0,
    fc_in: int | None = None,
    safetensors: bool | None = None,
    embedding: bool | None = None,
) -> Path:
    """An EAGLE-1/2 (version 1) or EAGLE-3 (version 3) head folder with the published keys (random weights);
    ``embedding``: write ``embed_tokens.weight`` (default: for EAGLE-1/2 only, as published)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h, kv_out = hidden, 2 * (hidden // 4)

    def w(*shape, s=0.2):
        return torch.randn(*shape, generator=gen) * s

    cfg = _llama_fields(hidden, vocab)
    attn_in = 2 * h if version == 3 else h
    prefix = "midlayer." if version == 3 else "layers.0."
    sd = {
        f"{prefix}self_attn.q_proj.weight": w(h, attn_in),
        f"{prefix}self_attn.k_proj.weight": w(kv_out, attn_in),
        f"{prefix}self_attn.v_proj.weight": w(kv_out, attn_in),
        f"{prefix}self_attn.o_proj.weight": w(h, h),
        f"{prefix}mlp.gate_proj.weight": w(2 * h, h),
        f"{prefix}mlp.up_proj.weight": w(2 * h, h),
        f"{prefix}mlp.down_proj.weight": w(h, 2 * h),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h),
    }
    if version == 3:
        dv = draft_vocab or vocab
        cfg["draft_vocab_size"] = dv
        sd |= {
            "fc.weight": w(h, fc_in or 3 * h),
            "midlayer.hidden_norm.weight": torch.ones(h),
            "midlayer.input_layernorm.weight": torch.ones(h),
            "norm.weight": torch.ones(h),
            "lm_head.weight": w(dv, h, s=2.0),
        }
        used = torch.sort(torch.randperm(vocab, generator=gen)[:dv]).values  # draft id -> target id
        sd["d2t"] = used - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
        sd["t2d"] = t2d
    else:
        cfg["bias"] = True
        sd |= {"fc.weight": w(h, fc_in or 2 * h), "fc.bias": torch.zeros(h)}
    if embedding if embedding is not None else version == 1:
        # EAGLE-1/2 checkpoints hold the target's embedding (cnets1.Model owns embed_tokens and ea_model.py loads
        # the state dict strict=True); EAGLE-3 ones take it from the target (load_emb) unless they hold one.
        sd["embed_tokens.weight"] = w(vocab, h, s=1.0)
    (folder / "config.json").write_text(json.dumps(cfg))
    if safetensors if safetensors is not None else version == 3:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(sd, folder / "pytorch_model.bin")
    return folder


def deep_llama(seed: int, layers: int = 8, sharpness: float = 32.0) -> torch.nn.Module:
    """A float64 Llama like ``models.tiny_llama`` (vocab 96, hidden 32) but ``layers`` deep: EAGLE-3 reads target
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
