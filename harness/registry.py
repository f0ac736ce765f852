"""The decoders' registry: the entry-point group ``dtbench.decoders`` through the one :class:`~dtbench.registry.Registry`
(its policy: built-ins declared in pyproject.toml like a plugin's, a built-in name never taken over, two
distributions claiming one name ambiguous, ``DTBENCH_DISABLE_PLUGINS`` honoured, the loaded class checked).

Also the one code path validating a plugin's own ``params:`` (:func:`validate_model`, decoders' and datasets').
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from dtbench.decoders.base import FAMILIES, Decoder, DecoderParams
from dtbench.harness.errors import DtbenchError, error_location
from dtbench.registry import BUILTIN_DISTRIBUTION, Discovery, Entry, Registry, subclass_of

__all__ = [
    "BUILTIN_DISTRIBUTION",
    "DECODERS",
    "DECODER_GROUP",
    "DecoderEntry",
    "Discovery",
    "Registry",
    "discover",
    "get",
    "scan",
    "validate_model",
    "validate_params",
]

DECODER_GROUP = "dtbench.decoders"  # the entry-point group decoders register under
DecoderEntry = Entry  # one registered decoder (the name tests and older code use)

DECODERS: Registry[type[Decoder]] = Registry(DECODER_GROUP, "decoder", subclass_of(Decoder))


def scan() -> Discovery:
    """The decoders' full discovery (usable, refused and ambiguous registrations)."""
    return DECODERS.scan()


def discover() -> dict[str, Entry]:
    """Usable registered decoders by name (nothing imported yet); see :class:`Registry`."""
    return DECODERS.scan().entries


def get(name: str) -> type[Decoder]:
    """The decoder class registered as ``name``.

    Raises:
        DtbenchError: for an unknown or ambiguous name (with the closest registered names), a broken plugin, or a
            decoder declaring a family that is not one of :data:`~dtbench.decoders.base.FAMILIES`.
    """
    found = DECODERS.scan()
    found.entries = discover()  # module-level discover() may be patched (tests inject fake entries)
    cls = DECODERS.get(name, found)
    if cls.family not in FAMILIES:
        raise DtbenchError(
            f"decoder '{name}' declares family {cls.family!r}; a decoder's family is one of {', '.join(FAMILIES)}"
        )
    return cls


def validate_params(name: str, params: dict[str, Any]) -> DecoderParams:
    """Validate a suite's ``params:`` against the decoder's own params model (:func:`validate_model`).

    Raises:
        DtbenchError: one line naming the decoder, the field and the problem.
    """
    return validate_model("decoder", name, get(name).Params, params)


def validate_model(kind: str, name: str, model: type[BaseModel], params: dict[str, Any]) -> Any:
    """Validate a suite entry's ``params:`` against a plugin's own pydantic ``Params`` model: the one code path for
    decoders' and datasets' params (:data:`dtbench.decoders.base.DecoderParams`,
    :class:`dtbench.harness.data.datasets.DatasetParams`).

    Args:
        kind: the plugin kind in messages ("decoder", "dataset").
        name: the registered name.
        model: the plugin's ``Params`` class.
        params: the suite's ``params:`` mapping.

    Returns:
        An instance of ``model``.

    Raises:
        DtbenchError: one line naming the plugin, the field and the problem, with the known parameters.
    """
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        loc, msg = error_location(exc)
        msg = "unknown parameter" if exc.errors()[0]["type"] == "extra_forbidden" else msg
        loc = loc or "params"
        known = ", ".join(model.model_fields) or "none"
        raise DtbenchError(f"{kind} '{name}': params.{loc}: {msg} (parameters: {known})") from None
