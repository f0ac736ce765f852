"""The test kit: seeded tiny causal LMs, drafting heads in their published formats and the list of built-in decoders
with the params every check runs them with.

Shared by the test suite (``tests/``) and the offline GPU check (:mod:`dtbench.gpucheck`, which runs on a node
where only the installed package is importable), so an installed module never reaches into the test tree. Nothing
here is used by a benchmark run: the models are random (no download) and the heads hold random weights.

- :func:`tiny_llama`, :func:`tiny_neox`, :func:`tiny_model`, :func:`perturbed`: 2-layer float64 models with vocabulary
  :data:`VOCAB` and seeded weights, their output layer scaled (:data:`FLAT`, :data:`SHARP`) so drafts are sometimes
  accepted.
- :func:`write_medusa`, :func:`write_eagle`: head folders in the published layouts, mirrored from the reference
  repositories:

  - Medusa-1 (FasterDecoding/Medusa medusa/model/medusa_model.py): config.json with medusa_num_heads and
    medusa_num_layers; medusa_lm_head.pt = state dict of the ModuleList of heads, keys {i}.{j}.linear.weight,
    {i}.{j}.linear.bias, {i}.{medusa_num_layers}.weight.
  - EAGLE-1/2 (SafeAILab/EAGLE eagle/model/cnets1.py): config.json (LlamaConfig fields, "bias"),
    pytorch_model.bin with embed_tokens.weight, fc.weight, fc.bias, layers.0.self_attn.{q,k,v,o}_proj.weight,
    layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight (no input_layernorm at
    index 0).
  - EAGLE-3 (SafeAILab/EAGLE eagle/model/cnets.py): config.json with draft_vocab_size; model.safetensors with
    fc.weight (no bias), midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
    midlayer.self_attn.{q,k,v}_proj.weight over 2h, midlayer.self_attn.o_proj.weight, midlayer.mlp.*, norm.weight,
    lm_head.weight (draft_vocab_size rows), d2t (int64), t2d (bool); embed_tokens.weight optional (``embedding``).

- :func:`builtin_settings`: (name, params) of every built-in decoder that decodes in this process, from each one's
  declared ``check_settings``, with :data:`HEAD` and :data:`STORE` placeholders for the files a caller writes (a head
  folder, a REST datastore).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

M = TypeVar("M", bound=torch.nn.Module)

# --- tiny models (no download) ----------------------------------------------------------------------------------------

VOCAB = 96
ARCHS = ("llama", "neox")
FLAT, SHARP = 8.0, 32.0
"""Output-weight scales. FLAT: mean top-1 probability about 0.07 (every node is uncertain; the property tests
scale DynaTree's thresholds down to it). SHARP: mean top-1 probability about 0.4-0.5, spread over (0.1, 1),
so the paper's default thresholds (tau=0.1, rho_stop=0.2, tau_l=0.4, tau_h=0.9) all act and real trees get
drafted with default params."""


def tiny_llama(seed: int, *, attn: str = "sdpa", sharpness: float = FLAT) -> LlamaForCausalLM:
    """A 2-layer Llama with vocab 96, hidden 32, float64, eval mode, seeded weights, lm_head scaled by
    ``sharpness``."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    return _sharpened(LlamaForCausalLM(cfg), sharpness)


def tiny_neox(seed: int, *, attn: str = "sdpa", sharpness: float = FLAT) -> GPTNeoXForCausalLM:
    """A 2-layer GPT-NeoX (the Pythia architecture: partial rotary embeddings on 25% of each head, parallel
    attention + MLP residual, untied output layer) with vocab 96, hidden 32, float64, eval mode, seeded weights,
    output layer scaled by ``sharpness``."""
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        rotary_pct=0.25,  # type: ignore[call-arg]  # Pythia's legacy key: transformers 5 takes it, undeclared
        use_parallel_residual=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    return _sharpened(GPTNeoXForCausalLM(cfg), sharpness)


def _sharpened(model: M, sharpness: float) -> M:
    # Larger output weights sharpen the next-token distribution, so drafts are sometimes accepted.
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        cast(PreTrainedModel, model).get_output_embeddings().weight.mul_(sharpness)
    return model


def tiny_model(arch: str, seed: int, *, attn: str = "sdpa", sharpness: float = FLAT) -> torch.nn.Module:
    """``tiny_llama`` or ``tiny_neox`` by name (``ARCHS``)."""
    make = {"llama": tiny_llama, "neox": tiny_neox}[arch]
    return make(seed, attn=attn, sharpness=sharpness)


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of std ``scale`` added to every weight (partial acceptance)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return other


# --- drafting heads in the published formats --------------------------------------------------------------------------


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


# --- the built-in decoders --------------------------------------------------------------------------------------------

HEAD = "<head written by build()>"  # params placeholder: a head folder the caller writes (write_medusa/write_eagle)
STORE = "<rest tokens file written by build()>"  # params placeholder: a REST datastore the caller writes


class Placeholders:
    """A :class:`~dtbench.testing.common.CheckContext` stand-in for callers that write the files params name
    themselves, sized for their own target (the GPU check's Pythia-shaped models): the file helpers return
    :data:`HEAD` / :data:`STORE` placeholders."""

    def medusa_head(self, heads: int = 4) -> str:
        return HEAD

    def eagle_head(self, version: int = 1) -> str:
        return HEAD

    def token_file(self, tokens: list[int] | None = None) -> str:
        return STORE


def builtin_settings() -> list[tuple[str, dict[str, Any]]]:
    """(name, params) of every built-in decoder that decodes in this process, one entry per setting it declares
    (:meth:`~dtbench.decoders.base.Decoder.check_settings`, issue 56: the list lives in the decoders), with
    :data:`HEAD` and :data:`STORE` placeholders for the files a caller writes."""
    from dtbench.harness import registry

    out: list[tuple[str, dict[str, Any]]] = []
    for name, entry in sorted(registry.discover().items()):
        cls = registry.get(name)
        if entry.distribution != "dtbench" or cls.requests:
            continue
        out.extend((name, dict(p)) for p in cls.check_settings(Placeholders()))
    return out
