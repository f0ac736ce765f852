"""This plugin's decoder through dtbench's conformance kit (``dtbench.testing``): the same named checks dtbench runs on
its own decoders. Copy this file into your plugin: one pytest id per decoder x check (``pytest -k greedy`` runs one),
a failure prints a one-line verdict and the counterexample the search found, a check that does not apply is skipped
with the declaration that rules it out.

Run from this folder after ``pip install .`` (the entry point registers ``prompt_lookup``): ``pytest``.
"""

from __future__ import annotations

import torch

from dtbench.testing import parametrize_with_checks

torch.set_num_threads(1)  # tiny models: intra-op threads only contend


@parametrize_with_checks(["prompt_lookup"])
def test_conformance(decoder, check):
    check(decoder)
