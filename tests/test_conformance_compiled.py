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
    """What the B = 3 leg found on CPU (2026-11-28, issue 59 item 6) is fixed: ``suffix``'s fallback draft caught
    up on a 17+ token backlog in bucket 32, outside its compiled sizes (now fed in pieces of k + 1:
    ``DraftModelProposer.max_feed``); ``hf_generate`` at B = 3 after B = 1 in one process reused the B = 1 pooled
    static cache (index_copy_ shape error; now a pool per batch size)."""
    check(decoder)
