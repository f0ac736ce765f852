"""The conformance kit's ``compiled_equals_eager`` check on every built-in decoder (issue 56; split from test_conformance.py
so that two xdist workers share the full tier's kit checks, issue 57): compiled execution equals eager (every compiled built-in: its compile step, zero recompiles
inside the sample at B = 1 and B = 3, only the declared buckets). Ids end in the device, as in
test_conformance.py.
"""

from __future__ import annotations

import pytest
from test_conformance import BUILTINS, DEVICES  # the one list of built-ins and devices

from dtbench.testing import parametrize_with_checks

TIER = "full"
pytestmark = pytest.mark.usefixtures("one_thread")


@parametrize_with_checks(BUILTINS, devices=DEVICES, checks=["compiled_equals_eager"])
def test_builtin_compiled_equals_eager(decoder, check):
    check(decoder)
