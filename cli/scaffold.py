"""``dtbench new-decoder NAME [--chain | --tree]``: a decoder plugin package to start from (issue 65 item 6).

Writes ``dtbench-NAME/`` (pyproject with the ``dtbench.decoders`` entry point, a decoder on the public API only, its
conformance tests through :func:`dtbench.testing.parametrize_with_checks`, a README). As generated it installs
(``pip install ./dtbench-NAME``) and passes ``dtbench check NAME``: a working method to change, not a stub.

- ``--chain`` (the default): a :class:`~dtbench.api.Proposer` on the one chain loop (:func:`~dtbench.api.
  speculate_chain`) that drafts by copying what followed the last earlier occurrence of the last token (prompt
  lookup decoding with one-token matches; Saxena 2023). No draft model.
- ``--tree``: an :class:`~dtbench.api.ExpansionPolicy` on the one tree loop (:class:`~dtbench.api.TreeDecoder`):
  a draft-model tree whose nodes branch in two where the draft is unsure (confidence below a threshold) and grow
  a single child where it is sure, up to depth D (a two-level form of DynaTree's confidence-driven breadth, paper
  section 3.2).
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

import click

from dtbench.harness.errors import DtbenchError

NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "{title}: a dtbench decoder plugin"
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["dtbench", "torch", "pydantic>=2"]

[project.optional-dependencies]
test = ["pytest", "hypothesis"]

# What makes `{name}` a dtbench decoder: one entry point in the `dtbench.decoders` group.
[project.entry-points."dtbench.decoders"]
{name} = "{module}:{cls}"

[tool.setuptools.packages.find]
where = ["src"]
"""

CHAIN = '''\
"""{title}: a dtbench decoder plugin (written by `dtbench new-decoder {name} --chain`; change the drafting).

A chain method writes only a :class:`~dtbench.api.Proposer`; the one chain loop (:func:`~dtbench.api.speculate_chain`)
owns the prefill, greedy or sampled verification (Leviathan et al. 2023), cache rollback, the T cap and stopping at EOS.
This proposer copies what followed the last earlier occurrence of the last token (prompt lookup decoding with
one-token matches, Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding), so no draft model is needed.

Only :mod:`dtbench.api` is imported: everything else in dtbench is internal and may move.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from pydantic import Field

from dtbench.api import Decoder, DecoderParams, KVTarget, Proposer, Step, speculate_chain


class {cls}Params(DecoderParams):
    """Hyperparameters (a suite's ``params:``; validated before any model loads).

    Attributes:
        num_draft_tokens: K, the most draft tokens verified per iteration.
    """

    num_draft_tokens: int = Field(4, ge=1, le=64, description="K: the most draft tokens verified per iteration")


class LastTokenLookup(Proposer):
    """Drafts the tokens that followed the last earlier occurrence of the last committed token.

    The chain loop calls ``begin(prompt, pending)`` once (the prompt ids and the prefill's token, not yet verified),
    then per iteration ``propose(max_tokens)`` (at most ``max_tokens`` ids: the loop caps K at what is left of T) and
    ``accept(drafts, accepted, committed)`` (``committed``: the accepted drafts followed by the target's own token).
    """

    def begin(self, prompt: list[int], pending: int) -> None:
        self.tokens = [*prompt, pending]

    def propose(self, max_tokens: int) -> list[int]:
        last = self.tokens[-1]
        for i in range(len(self.tokens) - 2, -1, -1):
            if self.tokens[i] == last:
                return self.tokens[i + 1 : i + 1 + max_tokens]
        return []

    def accept(self, drafts: list[int], accepted: int, committed: tuple[int, ...]) -> None:
        self.tokens.extend(committed)


class {cls}(Decoder[{cls}Params]):
    """{title}: drafts copied from the context, verified by the target; lossless (equals ``ar`` token for token)."""

    needs_draft = False  # True: the runner hands the suite's draft model as self.draft
    lossless = True  # the kit's greedy_equals_reference and sampling checks hold it to this
    supports_sampling = True  # the chain loop verifies by speculative sampling when the suite samples
    family = "chain"  # calibrated, priced and given a best K as the built-in chains
    compiles = True  # every forward goes through speculate_chain + KVTarget: it runs under `execution: compiled`
    version = "1"  # bump when the algorithm changes: results compare only within a version

    @classmethod
    def check_settings(cls, ctx) -> list[dict]:
        """The params `dtbench check` runs with: the defaults and a one-token chain."""
        return [{{}}, {{"num_draft_tokens": 1}}]

    @classmethod
    def verify_sizes(cls, params: {cls}Params) -> tuple[int, int]:
        """(K + 1, 0): the pending token and K drafts in one causal target forward, no tree mask."""
        return params.num_draft_tokens + 1, 0

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Exactly ``max_new_tokens`` tokens (fewer when the runner set ``eos_token_id`` and EOS came first), one Step
        per target forward; ``input_ids``: (1, prompt_len) int64 on the target's device, never written to."""
        yield from speculate_chain(
            KVTarget(self.target),
            LastTokenLookup(),
            input_ids,
            max_new_tokens,
            self.params.num_draft_tokens,
            self.sampling,
            self.generator,
            self.eos_token_id,
        )
'''

TREE = '''\
"""{title}: a dtbench decoder plugin (written by `dtbench new-decoder {name} --tree`; change the expansion policy).

A tree method writes only an :class:`~dtbench.api.ExpansionPolicy`; the one tree loop (:class:`~dtbench.api.TreeDecoder`,
``speculate_tree``) owns drafting with the draft model, the tree attention mask, verification, path selection, cache
updates, the T cap and stopping at EOS. This policy branches in two where the draft is unsure (its top-1
probability below ``low_confidence``) and grows one child where it is sure, to depth D: a two-level form of
DynaTree's confidence-driven breadth (DynaTree, section 3.2).

Only :mod:`dtbench.api` is imported: everything else in dtbench is internal and may move.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dtbench.api import ExpansionPolicy, TreeDecoder, TreeParams


class {cls}Params(TreeParams):
    """Hyperparameters (a suite's ``params:``), with every tree decoder's own (``tau``, ``n_max``, ``tree_root``, ...).

    Attributes:
        depth: D, the deepest drafted node (counted as ``tree_root`` says).
        low_confidence: a node whose draft top-1 probability is below this gets two children, else one.
    """

    depth: int = Field(4, ge=1, le=32, description="tree depth D")
    low_confidence: float = Field(0.5, gt=0.0, le=1.0, description="below this draft confidence, two children")


class TwoWayPolicy(ExpansionPolicy):
    """B(u) = 2 when c(u) < low_confidence else 1; a node expands while d(u) < D (pruning by tau and the node budget
    N_max are the loop's). One policy lives for one prompt."""

    def __init__(self, depth: int, low_confidence: float, tau: float, n_max: int):
        self.depth, self.low_confidence = depth, low_confidence
        self.max_breadth, self.tau, self.n_max = 2, tau, n_max

    @property
    def depth_limit(self) -> int:
        return self.depth

    def breadth(self, confidence: torch.Tensor) -> torch.Tensor:
        """(E,) float32 confidences c(u) -> (E,) int64 children per node, in [1, max_breadth]."""
        return torch.where(confidence < self.low_confidence, 2, 1).to(torch.long)

    def expandable(self, depth: int, cum_logp: torch.Tensor) -> torch.Tensor:
        """d(u) < D for every node of the level (a bool tensor shaped like ``cum_logp``)."""
        return torch.full(cum_logp.shape, depth < self.depth, dtype=torch.bool, device=cum_logp.device)


class {cls}(TreeDecoder[{cls}Params]):
    """{title}: a draft-model token tree, two children where the draft is unsure; lossless (equals ``ar``)."""

    version = "1"  # bump when the algorithm changes: results compare only within a version

    @classmethod
    def check_settings(cls, ctx) -> list[dict]:
        """The params `dtbench check` runs with: a shallow tree, and one that branches everywhere."""
        return [{{"depth": 3}}, {{"depth": 2, "low_confidence": 1.0, "tau": 0.0}}]

    @classmethod
    def tree_bounds(cls, params: {cls}Params) -> tuple[int, int]:
        """(largest breadth, largest depth) a tree can have: sizes the verification the cost model prices."""
        return 2, params.depth

    def make_policy(self) -> TwoWayPolicy:
        p = self.params
        return TwoWayPolicy(p.depth, p.low_confidence, p.tau, int(p.n_max))  # n_max "auto" is resolved by then
'''

TESTS = '''\
"""{title} through dtbench's conformance kit: one test id per check (``pytest -k greedy`` runs one). Each check runs in
a child process under a deadline: a hang or a crash fails its test id, never pytest. A failure prints a one-line
verdict and the counterexample; a check that does not apply is skipped with the declaration that rules it out.

Run after ``pip install -e .`` (the entry point registers ``{name}``): ``pytest``.
"""

from dtbench.testing import parametrize_with_checks


@parametrize_with_checks(["{name}"])
def test_conformance(decoder, check):
    check(decoder)
'''

README = """\
# {dist}

{title}: a decoder plugin for [dtbench](https://github.com/) (written by `dtbench new-decoder {name} {flag}`).

```bash
pip install -e .            # registers the decoder `{name}` (entry point in pyproject.toml)
dtbench decoders            # lists it with this distribution
dtbench check {name}        # the conformance kit: every check that applies, each in a child process
pip install -e '.[test]' && pytest   # the same checks as pytest ids
```

Use it in a suite: `decoders: [{{name: {name}, params: {{...}}}}]`. The decoder contract (every declaration, hook and
building block) is dtbench's docs/decoder-contract.md; the checks are docs/plugins.md, "Check your decoder".
"""


def camel(name: str) -> str:
    """``my_method`` -> ``MyMethod``."""
    return "".join(part.capitalize() for part in name.split("_") if part) or "Decoder"


def write_package(name: str, kind: str, parent: Path) -> Path:
    """Write the package ``dtbench-NAME`` for a ``kind`` ("chain" or "tree") decoder under ``parent``; its folder.

    Raises:
        DtbenchError: a name that is not a lowercase identifier, a built-in decoder's name, or a folder that exists.
    """
    from dtbench.harness import registry

    if not NAME.fullmatch(name) or keyword.iskeyword(name):
        raise DtbenchError(
            f"decoder name {name!r} is not a lowercase identifier (a-z, 0-9, _; starting with a letter; at most 40)"
        )
    builtin = {n for n, e in registry.discover().items() if e.builtin}
    if name in builtin:
        raise DtbenchError(f"'{name}' is a built-in decoder's name; a plugin may not take it over (choose another)")
    dist = f"dtbench-{name.replace('_', '-')}"
    folder = parent / dist
    if folder.exists():
        raise DtbenchError(f"{folder} exists already; remove it or choose another name or --dir")
    module, cls = f"dtbench_{name}", camel(name)
    title = f"{cls} ({'a chain' if kind == 'chain' else 'a tree'} speculative decoder)"
    fields = {"name": name, "dist": dist, "module": module, "cls": cls, "title": title, "flag": f"--{kind}"}
    package = folder / "src" / module
    package.mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "pyproject.toml").write_text(PYPROJECT.format(**fields))
    (package / "__init__.py").write_text((CHAIN if kind == "chain" else TREE).format(**fields))
    (folder / "tests" / "test_conformance.py").write_text(TESTS.format(**fields))
    (folder / "README.md").write_text(README.format(**fields))
    return folder


@click.command("new-decoder")
@click.argument("name")
@click.option("--chain", "kind", flag_value="chain", default=True, help="a Proposer on the one chain loop (default)")
@click.option("--tree", "kind", flag_value="tree", help="an expansion policy on the one tree loop (a draft model)")
@click.option(
    "--dir",
    "parent",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="where the package folder dtbench-NAME is written",
)
def new_decoder_command(name: str, kind: str, parent: Path) -> None:
    """Write a decoder plugin package to start from: dtbench-NAME/ with pyproject.toml (the entry point), a working
    decoder on the public API (dtbench.api), its conformance tests and a README. As written it installs and passes
    `dtbench check NAME`.

    \b
    Examples:
      dtbench new-decoder my_lookup            # a chain method: a Proposer on speculate_chain
      dtbench new-decoder my_tree --tree       # a tree method: an expansion policy on the tree loop
      pip install -e ./dtbench-my-lookup && dtbench check my_lookup
    """
    folder = write_package(name, kind, parent)
    click.echo(f"wrote {folder}/ (a {kind} decoder '{name}')")
    click.echo(f"next: pip install -e {folder} && dtbench check {name}")
