"""Learned drafting heads in their published formats: Medusa-1 and EAGLE-1/2/3 (modules and loaders).

Formats (read from the reference implementations, not guessed from checkpoint names):

- Medusa-1 (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads";
  FasterDecoding/Medusa ``medusa/model/medusa_model.py``): a folder with ``config.json`` holding
  ``medusa_num_heads`` and ``medusa_num_layers`` and ``medusa_lm_head.pt`` (or ``medusa_lm_head.safetensors``),
  the state dict of an ``nn.ModuleList`` of heads, head i = ``Sequential(ResBlock x medusa_num_layers,
  Linear(h, vocab, bias=False))``: keys ``{i}.{j}.linear.weight`` / ``{i}.{j}.linear.bias`` (ResBlock:
  ``x + SiLU(linear(x))``) and ``{i}.{medusa_num_layers}.weight``. Head i reads the target's last (final-normed)
  hidden state at position t and predicts the token at t + i + 2.
- EAGLE-1/2 (Li et al. 2024, "EAGLE" and "EAGLE-2"; SafeAILab/EAGLE ``eagle/model/cnets1.py``, ``ea_model.py``):
  ``config.json`` (a LlamaConfig, optional ``bias``) and ``pytorch_model.bin`` or ``model.safetensors``: ``fc``
  = Linear(2h, h) over [token embedding; target feature], one Llama decoder layer ``layers.0.*`` whose first
  input norm is absent (index 0), the target's embedding and LM head reused (no final norm: the head predicts
  the target's final-normed feature). The feature is the target's final-normed last hidden state.
- EAGLE-3 (Li et al. 2025, "EAGLE-3"; ``eagle/model/cnets.py``, ``modeling_llama_kv.py``): recognised by
  ``draft_vocab_size`` in config.json. ``fc`` = Linear(3 h_t, h, bias=False) over the inputs of target layers
  2, L // 2 and L - 3 (transformers' ``hidden_states[2]``, ``[L // 2]``, ``[L - 3]``), applied only to target
  features (the head's own outputs are fed back unchanged); ``midlayer`` with ``hidden_norm`` and
  ``input_layernorm`` over [embedding; feature] (q/k/v take 2h), its own ``norm`` and ``lm_head`` over the draft
  vocabulary, and ``d2t`` (draft id -> target id offset) / ``t2d`` buffers. The embedding is the target's
  unless the checkpoint holds ``embed_tokens.weight``.

Loading takes a local folder or a hub id (files fetched with ``huggingface_hub``; offline, only folders load).
Every mismatch with the target is a one-line :class:`ValueError` naming both sizes, raised at decoder
construction, before generation is timed.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
)

from dtbench.decoders.base import Decoder
from dtbench.decoders.tree.structure import attention_mask_kind, tree_attention_mask

# ----------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------


def head_file(head: str, names: tuple[str, ...]) -> Path:
    """The first of ``names`` found in ``head`` (a local folder, else a hub repository id).

    Raises:
        ValueError: none of the files exists locally or on the hub (one line, naming the head and the files).
    """
    folder = Path(head).expanduser()
    if folder.is_dir():
        for name in names:
            if (folder / name).is_file():
                return folder / name
        raise ValueError(f"head folder {head} holds none of {', '.join(names)}")
    from huggingface_hub import hf_hub_download

    errors = []
    for name in names:
        try:
            return Path(hf_hub_download(head, name))
        except Exception as exc:  # offline, missing repo or file: try the next name, report all
            errors.append(f"{name}: {type(exc).__name__}")
    raise ValueError(f"head {head!r} is not a local folder and could not be fetched from the hub "
                     f"({'; '.join(errors)})")


def _config(head: str) -> dict:
    path = head_file(head, ("config.json",))
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"head {head}: unreadable config.json ({exc})") from None


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"cannot read head weights {path}: {type(exc).__name__}: {exc}") from None


def _target_sizes(target: nn.Module) -> tuple[int, int]:
    """(hidden size, vocabulary size) of the target's LM head."""
    vocab, hidden = target.get_output_embeddings().weight.shape
    return int(hidden), int(vocab)


def _fits(what: str, head_size: int, target_size: int, head: str) -> None:
    if head_size != target_size:
        raise ValueError(f"head {head}: its {what} {head_size} does not fit the target's {what} {target_size}")


_LOADED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _cached(target: nn.Module, key: tuple, build):
    """One loaded head per (target model, head, kind): the runner builds a decoder per prompt."""
    per_target = _LOADED.setdefault(target, {})
    if key not in per_target:
        per_target[key] = build()
    return per_target[key]


class HeadDecoder(Decoder):
    """Base of the decoders that draft with a learned head on the target's features (``medusa``, ``eagle``).

    Capabilities: family ``tree`` (verification in the one tree loop, greedy); no draft model (the loaded head
    is the decoder's ``draft`` module, so the runner counts and times its forwards as draft forwards); lossless;
    greedy only (a suite that samples is refused before any model loads). Subclasses set :attr:`load_head` and
    declare ``verify_sizes``.

    Attributes:
        load_head: ``(head, target) -> nn.Module``, the loader of the subclass's published format (cached per
            target, raising a one-line ValueError for a head that does not fit).
    """

    family: ClassVar[str] = "tree"
    needs_draft = False
    lossless = True
    supports_sampling = False
    load_head: ClassVar[Callable[[str, nn.Module], nn.Module]]

    def __init__(self, target, draft, params):
        """Load the head named by ``params.head`` for ``target``.

        Raises:
            ValueError: missing or malformed head files, or a head whose sizes do not fit the target (one line
                naming both sizes; before anything is timed).
        """
        super().__init__(target, None, params)
        self.draft = self.load_head(params.head, target)

    @classmethod
    def check_target(cls, params, target: nn.Module) -> None:
        """Load the head for ``target`` when the run's models are loaded (the worker calls it before any sample).

        Raises:
            ValueError: as :meth:`__init__` (one line, both sizes).
        """
        cls.load_head(params.head, target)


# ----------------------------------------------------------------------------------------------------------
# Medusa-1
# ----------------------------------------------------------------------------------------------------------


class ResBlock(nn.Module):
    """Medusa's residual block: ``x + SiLU(linear(x))`` (medusa_model.py ResBlock)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """Medusa-1 heads; ``heads`` loads the published ``medusa_lm_head.pt`` state dict as is.

    Attributes:
        heads: ModuleList of ``Sequential(ResBlock x num_layers, Linear(h, vocab, bias=False))``.
    """

    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int):
        super().__init__()
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads))

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """Head logits from target features.

        Args:
            inputs_embeds: (1, n, h) the target's final-normed hidden states (named ``inputs_embeds`` so the
                runner's forward counter counts n positions fed to the draft).

        Returns:
            (num_heads, n, vocab) logits; head i predicts the token i + 2 positions after its input's position.
        """
        return torch.stack([head(inputs_embeds[0]) for head in self.heads])


def load_medusa(head: str, target: nn.Module) -> MedusaHeads:
    """Load Medusa-1 heads (folder or hub id) in the target's dtype and device (cached per target).

    Raises:
        ValueError: missing files or config fields, keys that are not Medusa-1's, or a hidden size or vocabulary
            that does not fit the target (one line, both sizes).
    """
    def build() -> MedusaHeads:
        cfg = _config(head)
        missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in cfg]
        if missing:
            raise ValueError(f"head {head}: config.json lacks {', '.join(missing)} (not a Medusa head)")
        layers = int(cfg["medusa_num_layers"])
        sd = _state_dict(head_file(head, ("medusa_lm_head.pt", "medusa_lm_head.safetensors")))
        ids = sorted({int(k.split(".", 1)[0]) for k in sd if k.split(".", 1)[0].isdigit()})
        if not ids or ids != list(range(len(ids))) or f"0.{layers}.weight" not in sd:
            raise ValueError(f"head {head}: medusa_lm_head keys are not Medusa-1's ({{i}}.{{j}}.linear.weight, "
                             f"{{i}}.{layers}.weight with medusa_num_layers={layers})")
        vocab, hidden = sd[f"0.{layers}.weight"].shape
        t_hidden, t_vocab = _target_sizes(target)
        _fits("hidden size", int(hidden), t_hidden, head)
        _fits("vocabulary size", int(vocab), t_vocab, head)
        module = MedusaHeads(len(ids), layers, t_hidden, t_vocab)
        try:
            module.heads.load_state_dict(sd, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"head {head}: {str(exc).splitlines()[0]}") from None
        return module.to(dtype=target.dtype, device=target.device).eval()

    return _cached(target, ("medusa", str(head)), build)


# ----------------------------------------------------------------------------------------------------------
# EAGLE-1/2/3
# ----------------------------------------------------------------------------------------------------------


class EagleLayer(nn.Module):
    """The head's decoder layer: EAGLE-1 ``layers.0`` (no input norm) or EAGLE-3 ``midlayer``.

    EAGLE-3 normalises the embedding (``input_layernorm``) and the feature (``hidden_norm``) and attends over
    their concatenation (q/k/v take 2h); the residual is the feature. EAGLE-1 attends over the fc output.
    """

    def __init__(self, config: LlamaConfig, eagle3: bool):
        super().__init__()
        self.eagle3 = eagle3
        self.self_attn = LlamaAttention(config, layer_idx=0)
        if eagle3:
            h, heads, kv, hd = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                self.self_attn.head_dim)
            self.self_attn.q_proj = nn.Linear(2 * h, heads * hd, bias=False)
            self.self_attn.k_proj = nn.Linear(2 * h, kv * hd, bias=False)
            self.self_attn.v_proj = nn.Linear(2 * h, kv * hd, bias=False)
            self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, emb, hidden, position_embeddings, mask, cache):
        residual = hidden
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1) if self.eagle3 else hidden
        x, _ = self.self_attn(x, position_embeddings, mask, cache)
        hidden = residual + x
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(nn.Module):
    """An EAGLE-1/2 or EAGLE-3 drafting head bound to its target's embedding (and, EAGLE-1, LM head).

    Attributes:
        version: 1 (EAGLE-1/2 layout) or 3.
        hidden_layers: the target ``hidden_states`` indices of its input feature.
        kind: the 4D mask format of its attention implementation (the target's).
    """

    def __init__(self, config: LlamaConfig, version: int, target: nn.Module, *, fc_in: int, fc_bias: bool,
                 own_embedding: bool):
        super().__init__()
        self.version = version
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(fc_in, h, bias=fc_bias)
        L = target.config.num_hidden_layers
        if version == 3:
            self.midlayer = EagleLayer(config, eagle3=True)
            self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
            self.hidden_layers = (2, L // 2, L - 3)
        else:
            self.layers = nn.ModuleList([EagleLayer(config, eagle3=False)])
            self.hidden_layers = (L,)
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self._target = (target.get_input_embeddings(), target.get_output_embeddings())  # not submodules
        self.rotary = LlamaRotaryEmbedding(config)
        self.kind = attention_mask_kind(target)

    @property
    def layer(self) -> EagleLayer:
        return self.midlayer if self.version == 3 else self.layers[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if hasattr(self, "embed_tokens") else self._target[0]
        return table(ids)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                ancestors: torch.Tensor, past_key_values) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over n (feature, token) pairs appended after its cache (cnets ``Model.forward``).

        Args:
            input_ids: (1, n) int64 target-vocabulary tokens; token i is the one that follows the position of
                feature i (EAGLE's pairing: feature of position t with token t + 1).
            features: (1, n, F) target features (F = 3 h_t for EAGLE-3 target features, else h) or the head's
                own outputs (h) when drafting deeper levels.
            position_ids: (1, n) int64 positions (the position of each pair's feature).
            ancestors: (n, k) bool, k >= n: which of the last k positions of [cache, fed] each fed position
                attends to (the n fed positions are the last n); every position before those k is visible to all.
                A causal block for committed pairs, the tree's ancestor rows when drafting.
            past_key_values: the head's ``DynamicCache`` (grows by n).

        Returns:
            (hidden (1, n, h): the head's output features, log-probabilities (n, V) float32 over its vocabulary:
            the target's for EAGLE-1/2, ``draft_vocab_size`` for EAGLE-3, mapped by :meth:`to_target`).
        """
        emb = self.embed(input_ids).to(features.dtype)
        if self.version == 3:
            if features.shape[-1] != self.config.hidden_size:
                features = self.fc(features)
        else:
            features = self.fc(torch.cat((emb, features), dim=-1))
        prefix = past_key_values.get_seq_length() + input_ids.shape[-1] - ancestors.shape[-1]
        mask = tree_attention_mask(ancestors, prefix, self.kind, features.dtype)
        pe = self.rotary(features, position_ids)
        hidden = self.layer(emb, features, pe, mask, past_key_values)
        logits = self.lm_head(self.norm(hidden)) if self.version == 3 else self._target[1](hidden)
        return hidden, torch.log_softmax(logits[0].float(), dim=-1)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids: EAGLE-3 with a reduced draft vocabulary ``id + d2t[id]``, identity
        otherwise (as cnets.py, which skips d2t when ``draft_vocab_size == vocab_size``)."""
        if self.version == 3 and self.config.draft_vocab_size != self.config.vocab_size:
            return ids + self.d2t[ids]
        return ids


def eagle_version(cfg: dict) -> int:
    """3 if the head's config.json declares ``draft_vocab_size`` (EAGLE-3's layout), else 1 (EAGLE-1/2)."""
    return 3 if "draft_vocab_size" in cfg else 1


def load_eagle(head: str, target: nn.Module) -> EagleHead:
    """Load an EAGLE-1/2 or EAGLE-3 head (folder or hub id) for ``target`` (cached per target).

    Raises:
        ValueError: missing files, weights of the other version's layout, or sizes that do not fit the target
            (hidden size, vocabulary, fc input; one line naming both sizes).
    """
    def build() -> EagleHead:
        cfg = _config(head)
        version = eagle_version(cfg)
        sd = _state_dict(head_file(head, ("model.safetensors", "pytorch_model.bin")))
        layer_key = "midlayer." if version == 3 else "layers.0."
        if "fc.weight" not in sd or not any(k.startswith(layer_key) for k in sd):
            raise ValueError(f"head {head}: weights lack fc.weight or {layer_key}* (config.json says EAGLE-"
                             f"{'3' if version == 3 else '1/2'})")
        t_hidden, t_vocab = _target_sizes(target)
        config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype", "dtype")})
        config._attn_implementation = getattr(target.config, "_attn_implementation", None) or "eager"
        _fits("vocabulary size", int(config.vocab_size), t_vocab, head)
        own_embedding = "embed_tokens.weight" in sd
        if not own_embedding or version == 1:
            _fits("hidden size", int(config.hidden_size), t_hidden, head)
        if "target_hidden_size" in cfg:  # EAGLE-3 heads narrower than their target
            _fits("target_hidden_size", int(cfg["target_hidden_size"]), t_hidden, head)
        fc_in = (3 if version == 3 else 2) * (t_hidden if version == 3 else int(config.hidden_size))
        _fits("fc input size", int(sd["fc.weight"].shape[1]), fc_in, head)
        if version == 3:
            if target.config.num_hidden_layers < 7:
                raise ValueError(f"head {head}: EAGLE-3 reads target layers 2, L//2 and L-3, which need L >= 7 "
                                 f"layers; the target has {target.config.num_hidden_layers}")
            _fits("lm_head vocabulary (draft_vocab_size)", int(sd["lm_head.weight"].shape[0]),
                  int(config.draft_vocab_size), head)
        module = EagleHead(config, version, target, fc_in=fc_in, fc_bias="fc.bias" in sd,
                           own_embedding=own_embedding)
        if version == 3 and not {"d2t", "t2d"} <= sd.keys():
            if config.draft_vocab_size != config.vocab_size:
                raise ValueError(f"head {head}: draft_vocab_size {config.draft_vocab_size} differs from vocab_size "
                                 f"{config.vocab_size} but the weights hold no d2t/t2d maps")
            sd = {**sd, "d2t": torch.zeros(config.draft_vocab_size, dtype=torch.long),
                  "t2d": torch.ones(config.vocab_size, dtype=torch.bool)}
        expected = {k for k in module.state_dict() if not k.startswith("rotary.")}
        # RoPE's inv_freq is computed, not learned: a checkpoint saved where it was a persistent buffer (older
        # transformers) holds it; the reference loads such files (strict=False since its EAGLE-3 release)
        sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
        unknown, absent = sorted(sd.keys() - expected), sorted(expected - sd.keys())
        if version == 3:  # the reference loads EAGLE-3 heads with strict=False: extra tensors are ignored
            unknown = [k for k in unknown if k.startswith("layers.")]
            sd = {k: v for k, v in sd.items() if k in expected}
        if unknown or absent:
            raise ValueError(f"head {head}: weights do not match the EAGLE-{'3' if version == 3 else '1/2'} layout "
                             f"(unexpected {unknown[:4]}, missing {absent[:4]})")
        try:
            module.load_state_dict(sd, strict=False)
        except RuntimeError as exc:  # a tensor shaped unlike its config.json says
            raise ValueError(f"head {head}: {' '.join(str(exc).split())[:300]}") from None
        module = module.to(dtype=target.dtype, device=target.device).eval()
        module.rotary = LlamaRotaryEmbedding(config).to(target.device)  # inv_freq stays float32, as the reference
        return module

    return _cached(target, ("eagle", str(head)), build)
