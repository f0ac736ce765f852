"""The conformance kit's ``sampling`` check on every built-in decoder (issue 56; split from test_conformance.py
so that two xdist workers share the full tier's kit checks, issue 57): sampling follows the target's distribution (every built-in that samples: a chi-square
test over a thousand generations per setting). Ids end in the device, as in
test_conformance.py.
"""

from __future__ import annotations

import pytest
from test_conformance import BUILTINS, DEVICES  # the one list of built-ins and devices

from dtbench.testing import parametrize_with_checks

TIER = "full"
pytestmark = pytest.mark.usefixtures("one_thread")


@parametrize_with_checks(BUILTINS, devices=DEVICES, checks=["sampling"])
def test_builtin_sampling(decoder, check):
    check(decoder)
