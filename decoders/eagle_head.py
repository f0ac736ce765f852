"""The EAGLE draft head (Li et al. 2024/2025, EAGLE-1/2/3; reference: SafeAILab/EAGLE eagle/model/cnets.py): its
layers as a module, its config and weight layout read and checked against the target, loaded once per (target, head)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from dtbench.decoders import modelinfo
from dtbench.decoders.tree.structure import MaskKind, attention_mask_kind, tree_attention_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel
from dtbench.decoders.heads import (
    cached_head,
    check_fits,
    check_shapes,
    head_file,
    lazy_weights,
    positive_int,
    read_config,
    state_dict_of,
    target_sizes,
)


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
            h, heads, kv_heads, hd = (
                config.hidden_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                self.self_attn.head_dim,
            )
            assert kv_heads is not None  # LlamaConfig's __post_init__ sets it (num_attention_heads by default)
            self.self_attn.q_proj = nn.Linear(2 * h, heads * hd, bias=False)
            self.self_attn.k_proj = nn.Linear(2 * h, kv_heads * hd, bias=False)
            self.self_attn.v_proj = nn.Linear(2 * h, kv_heads * hd, bias=False)
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
    """An EAGLE-1/2 or EAGLE-3 drafting head bound to its target's embedding (and, EAGLE-1, LM head); with
    ``target=None``, its layout only (built on the meta device to check a checkpoint's shapes, never run).

    Attributes:
        version: 1 (EAGLE-1/2 layout) or 3.
        hidden_layers: the target ``hidden_states`` indices of its input feature.
        kind: the 4D mask format of its attention implementation (the target's).
    """

    d2t: torch.Tensor  # EAGLE-3's buffers (registered in __init__)
    t2d: torch.Tensor

    def __init__(
        self,
        config: LlamaConfig,
        version: int,
        target: nn.Module | None,
        *,
        fc_in: int,
        fc_bias: bool,
        own_embedding: bool,
    ):
        super().__init__()
        self.version = version
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(fc_in, h, bias=fc_bias)
        L = modelinfo.config_of(target).num_hidden_layers if target is not None else 0
        self.hidden_layers: tuple[int, ...]
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
        self._target: tuple[nn.Module, nn.Module] | tuple[None, None] = (
            (
                cast("PreTrainedModel", target).get_input_embeddings(),
                cast("PreTrainedModel", target).get_output_embeddings(),
            )
            if target is not None
            else (None, None)
        )
        self.rotary = LlamaRotaryEmbedding(config)
        self.kind = attention_mask_kind(target) if target is not None else None

    @property
    def layer(self) -> EagleLayer:
        return self.midlayer if self.version == 3 else cast(EagleLayer, self.layers[0])

    def _bound(self) -> tuple[nn.Module, nn.Module, MaskKind]:
        """The target's embedding, LM head and mask format: a head built with ``target=None`` is a layout only
        (a checkpoint's shapes checked on the meta device) and never runs."""
        embedding, lm_head = self._target
        assert embedding is not None and lm_head is not None and self.kind is not None, "a layout-only head never runs"
        return embedding, lm_head, self.kind

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if hasattr(self, "embed_tokens") else self._bound()[0]
        return table(ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        ancestors: torch.Tensor,
        past_key_values,
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        mask = tree_attention_mask(ancestors, prefix, self._bound()[2], features.dtype)
        pe = self.rotary(features, position_ids)
        hidden = self.layer(emb, features, pe, mask, past_key_values)
        logits = self.lm_head(self.norm(hidden)) if self.version == 3 else self._bound()[1](hidden)
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


_EAGLE_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_EAGLE_OPTIONAL_SIZES = (
    "num_key_value_heads",
    "head_dim",
    "draft_vocab_size",
    "target_hidden_size",
    "max_position_embeddings",
)


def _eagle_config(head: str, cfg: dict) -> LlamaConfig:
    """The head's LlamaConfig, after checking the fields its layer is built from (positive integer sizes, heads
    dividing the hidden size, a positive ``rms_norm_eps``, a known ``hidden_act``).

    Raises:
        ValueError: the first bad field, naming the head and the field (one line).
    """
    from transformers.activations import ACT2FN

    sizes = {k: positive_int(cfg, k, head) for k in _EAGLE_SIZES}
    for k in _EAGLE_OPTIONAL_SIZES:
        if cfg.get(k) is not None:
            sizes[k] = positive_int(cfg, k, head)
    heads, kv = sizes["num_attention_heads"], sizes.get("num_key_value_heads", sizes["num_attention_heads"])
    if "head_dim" not in sizes and sizes["hidden_size"] % heads:
        raise ValueError(
            f"head {head}: config.json: hidden_size {sizes['hidden_size']} is not a multiple of "
            f"num_attention_heads {heads}"
        )
    if heads % kv:
        raise ValueError(
            f"head {head}: config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(
            f"head {head}: config.json: rms_norm_eps must be a number between 0 and 1, not {json.dumps(eps)[:40]}"
        )
    act = cfg.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in ACT2FN:
        raise ValueError(
            f"head {head}: config.json: hidden_act {json.dumps(act)[:40]} is not an activation transformers knows"
        )
    try:
        return LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype", "dtype")})
    except Exception as exc:  # noqa: BLE001  (transformers' strict config validation: any bad field)
        raise ValueError(
            f"head {head}: config.json is not a Llama config ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None


class EagleShape(TypedDict):
    """:class:`EagleHead`'s keyword arguments read from a checkpoint's tensors."""

    fc_in: int
    fc_bias: bool
    own_embedding: bool


def _eagle_layout(
    head: str, cfg: dict, shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor]
) -> tuple[LlamaConfig, int, EagleShape]:
    """(LlamaConfig, version, EagleHead keyword arguments) of an EAGLE head, config.json and every weight's shape
    checked against the layout they make (built on the meta device: nothing allocated), and EAGLE-3's ``d2t``
    checked to map every draft id into ``vocab_size``.

    Raises:
        ValueError: a bad config field, weights of the other version's layout, unexpected or missing tensors, a
            tensor shaped unlike the layout, a draft id mapped outside the vocabulary (one line naming the head).
    """
    version = eagle_version(cfg)
    layer_key = "midlayer." if version == 3 else "layers.0."
    if "fc.weight" not in shapes or not any(k.startswith(layer_key) for k in shapes):
        raise ValueError(
            f"head {head}: weights lack fc.weight or {layer_key}* (config.json says EAGLE-"
            f"{'3' if version == 3 else '1/2'})"
        )
    config = _eagle_config(head, cfg)
    fc = shapes["fc.weight"]
    if len(fc) != 2 or 0 in fc:
        raise ValueError(f"head {head}: fc.weight has shape {list(fc)}, not a matrix")
    kwargs: EagleShape = {
        "fc_in": int(fc[1]),
        "fc_bias": "fc.bias" in shapes,
        "own_embedding": "embed_tokens.weight" in shapes,
    }
    with torch.device("meta"):
        layout = EagleHead(config, version, None, **kwargs)
    expected = {k for k in layout.state_dict() if not k.startswith("rotary.")}
    synthesized = set()
    if version == 3 and not {"d2t", "t2d"} <= shapes.keys():
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(
                f"head {head}: draft_vocab_size {config.draft_vocab_size} differs from vocab_size "
                f"{config.vocab_size} but the weights hold no d2t/t2d maps"
            )
        synthesized = {"d2t", "t2d"}  # identity maps, filled in by the loader
    # RoPE's inv_freq is computed, not learned: a checkpoint saved where it was a persistent buffer (older
    # transformers) holds it; the reference loads such files (strict=False since its EAGLE-3 release)
    given = {k for k in shapes if not k.endswith("rotary_emb.inv_freq")}
    unknown, absent = sorted(given - expected), sorted(expected - given - synthesized)
    if version == 3:  # the reference loads EAGLE-3 heads with strict=False: extra tensors are ignored
        unknown = [k for k in unknown if k.startswith("layers.")]
    if unknown or absent:
        raise ValueError(
            f"head {head}: weights do not match the EAGLE-{'3' if version == 3 else '1/2'} layout "
            f"(unexpected {unknown[:4]}, missing {absent[:4]})"
        )
    check_shapes(head, layout, shapes)
    if version == 3 and "d2t" in shapes and config.draft_vocab_size != config.vocab_size:
        _check_d2t(head, read("d2t"), config.vocab_size)
    return config, version, kwargs


def _check_d2t(head: str, d2t: torch.Tensor, vocab: int) -> None:
    """EAGLE-3's draft id -> target id map (``id + d2t[id]``) lands in [0, vocab) for every draft id.

    Raises:
        ValueError: a non-integer map, or the first draft id mapped outside the vocabulary.
    """
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.dtype.is_complex:
        raise ValueError(f"head {head}: d2t holds {d2t.dtype} values, not integer token offsets")
    mapped = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.reshape(-1).to(torch.int64)
    bad = torch.nonzero((mapped < 0) | (mapped >= vocab)).reshape(-1)
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"head {head}: d2t maps draft id {i} to token {int(mapped[i])}, outside the vocabulary "
            f"(0..{vocab - 1}); {len(bad)} draft ids are mapped outside it"
        )


def _eagle_file(head: str) -> Path:
    return head_file(head, ("model.safetensors", "pytorch_model.bin"))


def check_eagle(head: str) -> None:
    """Check an EAGLE head's files (config.json, the weights' header, EAGLE-3's d2t) without allocating it.

    Raises:
        ValueError: as :func:`_eagle_layout`, or unreadable files.
    """
    cfg = read_config(head)
    shapes, read = lazy_weights(_eagle_file(head))
    _eagle_layout(head, cfg, shapes, read)


def load_eagle(head: str, target: nn.Module) -> EagleHead:
    """Load an EAGLE-1/2 or EAGLE-3 head (folder or hub id) for ``target`` (cached per target).

    Raises:
        ValueError: missing files, bad config fields, weights of the other version's layout or shaped unlike
            config.json says, an EAGLE-3 d2t mapping outside the vocabulary, or sizes that do not fit the target
            (hidden size, vocabulary, fc input; one line naming both sizes); all before the head is allocated.
    """

    def build() -> EagleHead:
        cfg = read_config(head)
        sd = state_dict_of(_eagle_file(head))
        config, version, kwargs = _eagle_layout(head, cfg, {k: tuple(v.shape) for k, v in sd.items()}, sd.__getitem__)
        t_hidden, t_vocab = target_sizes(target)
        config._attn_implementation = getattr(target.config, "_attn_implementation", None) or "eager"
        check_fits("vocabulary size", int(config.vocab_size), t_vocab, head)
        if not kwargs["own_embedding"] or version == 1:
            check_fits("hidden size", int(config.hidden_size), t_hidden, head)
        if "target_hidden_size" in cfg:  # EAGLE-3 heads narrower than their target
            check_fits("target_hidden_size", int(cfg["target_hidden_size"]), t_hidden, head)
        fc_in = (3 if version == 3 else 2) * (t_hidden if version == 3 else int(config.hidden_size))
        check_fits("fc input size", kwargs["fc_in"], fc_in, head)
        if version == 3:
            if modelinfo.config_of(target).num_hidden_layers < 7:
                raise ValueError(
                    f"head {head}: EAGLE-3 reads target layers 2, L//2 and L-3, which need L >= 7 "
                    f"layers; the target has {modelinfo.config_of(target).num_hidden_layers}"
                )
            check_fits(
                "lm_head vocabulary (draft_vocab_size)",
                int(sd["lm_head.weight"].shape[0]),
                int(config.draft_vocab_size),
                head,
            )
        module = EagleHead(config, version, target, **kwargs)
        if version == 3 and not {"d2t", "t2d"} <= sd.keys():
            sd = {
                **sd,
                "d2t": torch.zeros(config.draft_vocab_size, dtype=torch.long),
                "t2d": torch.ones(config.vocab_size, dtype=torch.bool),
            }
        expected = {k for k in module.state_dict() if not k.startswith("rotary.")}
        sd = {k: v for k, v in sd.items() if k in expected}  # unknown tensors were refused or are ignored (EAGLE-3)
        try:
            module.load_state_dict(sd, strict=False)
        except RuntimeError as exc:  # a tensor shaped unlike its config.json says
            raise ValueError(f"head {head}: {' '.join(str(exc).split())[:300]}") from None
        module = module.to(dtype=modelinfo.dtype_of(target), device=modelinfo.device_of(target)).eval()
        module.rotary = LlamaRotaryEmbedding(config).to(
            modelinfo.device_of(target)
        )  # inv_freq stays float32, as the reference
        return module

    return cached_head(target, ("eagle", str(head)), build)
