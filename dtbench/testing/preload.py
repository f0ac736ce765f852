"""What the conformance kit's fork server imports once (:func:`dtbench.testing.process.context`): torch,
transformers' tiny-model classes and the kit, so that each decoder's child process starts without importing them."""

from transformers import GPTNeoXForCausalLM, LlamaForCausalLM  # noqa: F401  (the tiny pairs' classes)

import dtbench.testing  # noqa: F401  (the kit, torch, hypothesis)
from dtbench.testing import checks, contract  # noqa: F401
