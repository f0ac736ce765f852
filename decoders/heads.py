"""Learned drafting heads in their published formats: Medusa-1 and EAGLE-1/2/3: what every head shares (reading a
head's folder, checking its shapes against the target, one load per (target, head), :class:`HeadDecoder`); the heads'
modules and loaders are :mod:`dtbench.decoders.medusa_head` and :mod:`dtbench.decoders.eagle_head`.

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

A head's files are checked before anything is allocated (:func:`check_eagle`, :func:`check_medusa`): config.json
is a JSON object whose sizes are positive integers (``"576"``, ``-5``, ``0``, ``true`` refused, each naming the head
and the field); the head's layout is built from it on PyTorch's ``meta`` device (no memory) and every tensor's shape
compared with the weights file's (read from its header: safetensors' header, or a ``torch.load(mmap=True)`` that
reads no data), so ``intermediate_size: 3000000`` beside 1536-wide weights is one line, not three 6.9 GB matrices;
EAGLE-3's ``d2t`` must map every draft id into the vocabulary. ``dtbench validate`` and the run's preflight run
these checks on local head folders before any model loads (:meth:`HeadDecoder.check_files`); a hub head is checked
the same way when it is fetched, still before its module is allocated.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, cast

import torch
from torch import nn

from dtbench.decoders.base import Decoder

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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
    raise ValueError(f"head {head!r} is not a local folder and could not be fetched from the hub ({'; '.join(errors)})")


MAX_CONFIG_BYTES = 1 << 20  # a head's config.json


def read_config(head: str) -> dict:
    """The head's config.json as a dict.

    Raises:
        ValueError: unreadable, larger than 1 MiB, not JSON, or not a JSON object (one line naming the head).
    """
    from dtbench.core import DtbenchError, read_regular_file

    path = head_file(head, ("config.json",))
    try:
        cfg = json.loads(read_regular_file(path, MAX_CONFIG_BYTES, what="head config").decode("utf-8"))
    except DtbenchError as exc:
        raise ValueError(f"head {head}: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"head {head}: unreadable config.json ({type(exc).__name__}: {exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"head {head}: config.json is a JSON {type(cfg).__name__}, not an object of settings")
    return cfg


def state_dict_of(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"cannot read head weights {path}: {type(exc).__name__}: {exc}") from None


def lazy_weights(path: Path) -> tuple[dict[str, tuple[int, ...]], Callable[[str], torch.Tensor]]:
    """(name -> shape, a reader of one tensor) of a weights file without reading its data: safetensors' header, or
    ``torch.load(mmap=True, weights_only=True)`` (its tensors stay on disk until read).

    Raises:
        ValueError: the file cannot be read as weights (one line).
    """
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

            def read(key: str) -> torch.Tensor:
                with safe_open(str(path), "pt") as g:
                    return g.get_tensor(key)

            return shapes, read
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be mapped: read it (bounded by the file)
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"cannot read head weights {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"head weights {path} are not a state dict of tensors")
    return {k: tuple(v.shape) for k, v in sd.items()}, sd.__getitem__


def positive_int(cfg: dict, key: str, head: str, default: int | None = None) -> int:
    """``cfg[key]`` as a positive integer (``default`` when absent and a default is given).

    Raises:
        ValueError: absent without a default, or not a positive integer (a string, a bool, a float, <= 0).
    """
    if key not in cfg or (cfg[key] is None and default is not None):
        if default is None:
            raise ValueError(f"head {head}: config.json lacks {key}")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"head {head}: config.json: {key} must be a positive integer, not {json.dumps(value)[:40]}")
    return value


def check_shapes(head: str, layout: nn.Module, shapes: dict[str, tuple[int, ...]], skip=()) -> None:
    """Every tensor of ``layout`` (built on the meta device from config.json) has the file's shape.

    Raises:
        ValueError: the first tensor whose shape differs (naming both shapes).
    """
    for key, tensor in layout.state_dict().items():
        if key in shapes and not key.startswith(tuple(skip)) and tuple(tensor.shape) != shapes[key]:
            raise ValueError(
                f"head {head}: {key} has shape {list(shapes[key])} in the weights, but config.json "
                f"makes it {list(tensor.shape)}"
            )


def target_sizes(target: nn.Module) -> tuple[int, int]:
    """(hidden size, vocabulary size) of the target's LM head."""
    vocab, hidden = cast("PreTrainedModel", target).get_output_embeddings().weight.shape
    return int(hidden), int(vocab)


def check_fits(what: str, head_size: int, target_size: int, head: str) -> None:
    if head_size != target_size:
        raise ValueError(f"head {head}: its {what} {head_size} does not fit the target's {what} {target_size}")


_LOADED: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def cached_head(target: nn.Module, key: tuple, build):
    """One loaded head per (target model, head, kind): the runner builds a decoder per prompt."""
    per_target = _LOADED.setdefault(target, {})
    if key not in per_target:
        per_target[key] = build()
    return per_target[key]


class HeadLoader(Protocol):
    """``(head, target) -> nn.Module``: a published format's loader (:func:`load_medusa`, :func:`load_eagle`)."""

    def __call__(self, head: str, target: nn.Module, /) -> nn.Module: ...


class HeadChecker(Protocol):
    """``(head) -> None``: a published format's file check (:func:`check_medusa`, :func:`check_eagle`)."""

    def __call__(self, head: str, /) -> None: ...


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

    family = "tree"
    needs_draft = False
    lossless = True
    supports_sampling = False
    load_head: ClassVar[HeadLoader]
    check_head: ClassVar[HeadChecker]

    def __init__(self, target, draft, params):
        """Load the head named by ``params.head`` for ``target``.

        Raises:
            ValueError: missing or malformed head files, or a head whose sizes do not fit the target (one line
                naming both sizes; before anything is timed).
        """
        super().__init__(target, None, params)
        self.draft = self.load_head(params.head, target)

    @classmethod
    def check_files(cls, params) -> None:
        """Check a local head folder's config.json and weights (sizes, layout, shapes from the file's header) without
        loading any model or allocating the head: ``dtbench validate`` and the run's preflight call it. A hub id is
        checked when it is fetched (:meth:`check_target`), before the head is allocated.

        Raises:
            ValueError: one line naming the head and the field or tensor.
        """
        if Path(params.head).expanduser().is_dir():
            cls.check_head(params.head)

    @classmethod
    def check_target(cls, params, target: nn.Module) -> None:
        """Load the head for ``target`` when the run's models are loaded (the worker calls it before any sample).

        Raises:
            ValueError: as :meth:`__init__` (one line, both sizes).
        """
        cls.load_head(params.head, target)
