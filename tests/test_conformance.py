"""Every built-in decoder through the conformance kit (issue 56 item 4): the one source of the built-ins' property
tests (greedy equals the reference, batch rows, Step accounting, host reads, no state across prompts, compiled equals
eager, sampling), one pytest id per decoder x check x device, exactly as a plugin's own tests call the kit
(examples/dtbench-prompt-lookup/tests). Which checks apply follows from each decoder's declarations; its params from
its ``check_settings``.

The fast tier runs the cheap checks at the fast tier's example cap; compiled execution and sampling (compiles, a
thousand generations per setting) run in the full tier, each in a module of its own (test_conformance_compiled.py,
test_conformance_sampling.py) so that two xdist workers share them (``--dist loadfile``). Ids end in the device (``-cpu``, ``-cuda``,
``-cuda-float16``): the GPU check's tests step selects ``-k cuda``, its CPU dry run ``-k cpu``.
"""

from __future__ import annotations

import pytest

from dtbench.harness import registry
from dtbench.testing import check_names, parametrize_with_checks

TIER = "fast"
pytestmark = pytest.mark.usefixtures("one_thread")

BUILTINS = sorted(n for n, e in registry.discover().items() if e.distribution == "dtbench")
CHEAP = [n for n in check_names() if n not in ("compiled_equals_eager", "sampling")]  # no compiles, no laws
DEVICES = ("cpu", "cuda", "cuda-float16")


@parametrize_with_checks(BUILTINS, devices=DEVICES, checks=CHEAP)
def test_builtin(decoder, check):
    check(decoder)


def test_every_builtin_declares_valid_settings():
    """Every built-in's declared settings validate (a bad declaration would fail every check, late)."""
    from dtbench.testing.common import PRECISIONS, CheckContext, pair, settings_of

    ctx = CheckContext(pair("llama", "self", 8.0, PRECISIONS["cpu"])[0])
    for name in BUILTINS:
        if registry.get(name).requests:  # a server's params name an endpoint: no check runs it in this process
            continue
        settings = settings_of(registry.get(name), ctx)
        assert isinstance(settings, list) and settings, name
