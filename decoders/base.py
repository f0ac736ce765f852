"""The decoder contract every dtbench decoder follows, built-in or third-party.

A decoder is a class registered under the entry-point group ``dtbench.decoders``. It declares its
hyperparameters as a pydantic model (``Params``), whether it needs a draft model, whether it is lossless
(its greedy output equals the target's greedy output), and its capabilities: its ``family`` (how reports and the
cost model treat it), the ``verify_sizes`` a configuration can use (what calibration measures) and its
``reference`` (what its output is compared with). The harness and the reports read these, never decoder names. It generates by yielding one :class:`Step` per target
verification; the runner, never the decoder, timestamps those steps (docs/architecture.md, "Decoder contract"); a
push-based decoder stamps them with the runner's own clock (``Step.at``, :func:`commit_clock`).
"""

from __future__ import annotations

import time
import typing
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

import torch
from pydantic import ConfigDict

from dtbench.core import Corpus, CorpusSpec, StrictBools
from dtbench.decoders.cut import eos_end

if TYPE_CHECKING:
    from dtbench.decoders.sampling import SamplingSettings


@dataclass(frozen=True, slots=True)
class Step:
    """What one target verification (one iteration) committed.

    Attributes:
        tokens: token ids committed in this iteration, in order (at least one).
        drafted: draft tokens proposed to the target in this iteration: the drafted nodes it verified, i.e. the
            paper's tree size for tree decoders, K for linear speculation, 0 for autoregressive decoding.
        accepted: drafted tokens that matched the target's greedy prediction and were committed
            (the committed path length before the bonus token, paper section 3.5).
        depth: drafted tokens on the longest root-to-leaf path of this iteration's tree (K for a chain, 0 for
            AR), so ``accepted <= depth``. For a tree rooted as the paper roots it (``tree_root: paper``, the
            draft's top-1 token u0 at depth 0) this is the deepest node's paper depth + 1; for a
            ``tree_root: pending`` tree it is the deepest node's depth.
        at: the commit time of a *push-based* decoder's iteration, seconds on :func:`commit_clock`'s clock (read
            after synchronizing the device, at the moment the iteration's tokens were known), or None (the usual
            pull-based decoder: the runner reads the clock when the Step is yielded). A decoder whose loop is a
            blocking call it does not own (transformers' ``generate`` with a streamer, issue 47) records each
            iteration's ``at`` in the call and yields the Steps afterwards; the one timing loop
            (:func:`dtbench.harness.measurement.measure.measure_rows`) takes the time and the forwards counted up to it from
            ``at`` exactly as it would have at a yield.

    Forward passes are not part of a Step: the runner counts the target's and the draft's with hooks.
    """

    tokens: tuple[int, ...]
    drafted: int = 0
    accepted: int = 0
    depth: int = 0
    at: float | None = None


def clock() -> float:
    """The one clock every timing in dtbench reads: ``time.perf_counter``, seconds. The runner's loop and forward
    timer (:func:`dtbench.harness.measurement.forwards.now`) and push-based decoders (:func:`commit_clock`) all call it, so a
    test that replaces it (a fake machine) replaces it everywhere at once."""
    return time.perf_counter()


def commit_clock(device: torch.device) -> float:
    """:func:`clock` read after synchronizing ``device`` (CUDA work is asynchronous; a no-op on CPU): what a
    push-based decoder stamps a :class:`Step`'s ``at`` with."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


class DecoderParams(StrictBools):
    """Base for every decoder's hyperparameters: frozen, unknown keys rejected, booleans never taken as numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # no NaN/inf in any float param


P = TypeVar("P", bound=DecoderParams)  # a decoder's params model: Decoder[NgramParams] reads self.params.k typed

Family = Literal["ar", "chain", "tree", "external"]
FAMILIES: tuple[str, ...] = typing.get_args(Family)


class Decoder(ABC, Generic[P]):
    """A generation strategy under benchmark.

    Subclasses name their params model (``class Ngram(Decoder[NgramParams])``, so ``self.params`` is typed), set the
    class attributes, implement :meth:`generate` and, where the defaults are wrong, override the capability
    classmethods :meth:`verify_sizes` and :meth:`reference`.

    Class attributes:
        Params: the pydantic model of the decoder's hyperparameters (validated before any model loads).
        needs_draft: True if the decoder uses a draft model.
        lossless: True if its greedy output must equal the reference decoder's output token for token (and, when
            it samples, its output distribution the target's).
        version: bumped when the algorithm changes, so results stay comparable only within a version.
        supports_sampling: True if it honours ``self.sampling`` / ``self.generator`` (set by the runner; a suite
            that samples is refused for decoders without it).
        batching: True if it decodes B prompts together (:meth:`generate_batch`, suite key ``batch_sizes``):
            ``ar``, the chain and tree decoders through the one chain/tree loop, ``hf_generate`` through transformers'
            batched ``generate``. A suite asking a decoder without it for B > 1 is refused at validate (a
            capability, never a name).
        batch_sampling: True if :meth:`generate_batch` samples too when ``self.sampling`` is set: every row an
            independent draw of the target's processed law, the rows sharing ``self.generator`` (a row's tokens are
            not those its prompt draws alone). ``ar`` and the chain decoders; a sampled suite at B > 1 is refused for
            a decoder without it, and the kit's ``sampling`` check draws the batched law too.
        family: what kind of loop it runs, stored on every cell (``cells.family``) and read by the reports:
            ``"ar"`` one target forward per token, nothing drafted (the paper's AR rows); ``"chain"`` a drafted
            chain of K tokens verified in one target forward (:func:`dtbench.decoders.chain.speculate_chain`; the
            cost model predicts its best K from the per-position acceptance); ``"tree"`` a drafted token tree
            verified with a tree mask (:func:`dtbench.decoders.tree.speculate_tree`; the paper's tree tables and
            ablation); ``"external"`` another library's loop (the default: nothing is assumed).
        compiles: True if it runs in compiled execution (suite key ``execution: compiled``, issue 37): its forwards
            go through :mod:`dtbench.decoders.kv` (``new_cache``/``forward``/``crop``/``keep_positions``), which
            inside :func:`dtbench.decoders.static_kv.compiled` keep static caches and run bucketed ``torch.compile``d
            forwards (``ar``, the one chain loop, the one tree loop with a draft model, ``hf_generate`` through
            transformers' static cache). A suite asking a decoder without it for ``compiled`` is refused at validate.
        requests: True if it is measured through requests to a server (``server``, issue 30): the harness's
            bounded async client (:mod:`dtbench.harness.serving`) sends each prompt of a prompt group as one streamed
            request, the load level B being the requests in flight (the suite's ``concurrency:``), and times every
            streamed chunk; :meth:`generate` is never called and no forward runs in dtbench's process.
        own_process: device types ("cuda", "cpu") on which, under ``isolation: process``, the decoder is measured in
            a child process of its own, where no other decoder ran (:mod:`dtbench.harness.execution.isolation`; issue 38). No
            built-in sets it since issue 47 (transformers' ``generate``, the decoder it was for, no longer runs in a
            greenlet); it stays for third-party decoders that need a fresh process.
        xfail_checks: conformance checks (:mod:`dtbench.testing`) this decoder knowingly fails, each with its reason:
            ``{"check": "why"}`` or, for one precision, ``{"check[cuda-float16]": "why"}`` (scikit-learn's
            ``_xfail_checks``, issue 65). ``dtbench check`` shows such a failure as ``xfail`` with the reason and a
            pass as ``xpass``, a failure (strict: the declaration is stale). No built-in declares one.

    ``class X(Decoder[XParams])`` binds ``Params = XParams`` when the class does not set ``Params`` itself.
    """

    Params: ClassVar[type[DecoderParams]] = DecoderParams
    family: ClassVar[Family] = "external"
    needs_draft: ClassVar[bool] = False
    lossless: ClassVar[bool] = True
    version: ClassVar[str] = "1"
    supports_sampling: ClassVar[bool] = False
    batching: ClassVar[bool] = False
    batch_sampling: ClassVar[bool] = False
    compiles: ClassVar[bool] = False
    requests: ClassVar[bool] = False
    own_process: ClassVar[tuple[str, ...]] = ()
    xfail_checks: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Bind ``Params`` from the subscripted base (``class X(Decoder[XParams])``) when the class sets none: a
        decoder written as the type annotation says gets its params model, never the empty base (issue 65 item 6)."""
        super().__init_subclass__(**kwargs)
        if "Params" in cls.__dict__:
            return
        for base in cls.__dict__.get("__orig_bases__", ()):
            args = typing.get_args(base)
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Decoder) and args:
                model = args[0]
                if isinstance(model, type) and issubclass(model, DecoderParams):
                    cls.Params = model
                    return

    # Set by the runner before generate() when the suite samples (dtbench.decoders.sampling); None: greedy.
    sampling: Any = None  # SamplingSettings | None
    generator: torch.Generator | None = None  # the sample's own seeded generator (no global RNG state)
    # Set by the runner when the workload stops at EOS (``stop_at_eos: true``): the target's EOS id(s). None: EOS is an
    # ordinary token and exactly T tokens are generated (the paper's fixed-T protocol). The shared loops
    # (speculate_chain, speculate_tree, ar, the transformers decoders) end at the first EOS through cut_at_eos.
    eos_token_id: int | tuple[int, ...] | None = None
    # Set through use_corpus() by the harness when corpus_of(params) declares one.
    corpus: Corpus | None = None

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None, params: P):
        """Bind the models and validated params.

        Args:
            target: the target causal LM (a transformers ``PreTrainedModel``), in eval mode.
            draft: the draft causal LM sharing the target's vocabulary, or None if ``needs_draft`` is False.
            params: an instance of ``self.Params``.

        Raises:
            ValueError: if the decoder needs a draft model and none is given.
        """
        if self.needs_draft and draft is None:
            raise ValueError(f"decoder {type(self).__name__} needs a draft model, and the suite declares none")
        self.target = target
        self.draft = draft
        self.params = params

    @classmethod
    def lossless_with(cls, params: P) -> bool:
        """Whether this decoder is lossless with ``params`` (stored as the cell's ``lossless_expected``): the
        class's :attr:`lossless` by default; a decoder with an opt-in lossy mode (``medusa``'s typical acceptance)
        overrides it."""
        return cls.lossless

    @classmethod
    def sampling_error(cls, params: P) -> str | None:
        """Why this decoder cannot sample with ``params`` (a one-line reason), or None if it can.

        Only asked when ``supports_sampling`` is True; a decoder whose sampling is lossless only for some params
        overrides it (the plan refuses such a cell before any model loads).
        """
        return None

    @classmethod
    def batching_error(cls, params: P) -> str | None:
        """Why this decoder cannot decode batches with ``params`` (a one-line reason), or None if it can.

        Only asked when ``batching`` is True and the suite asks for B > 1 (the plan refuses such a cell at validate).
        """
        return None

    @classmethod
    def compile_error(cls, params: P) -> str | None:
        """Why this decoder cannot run compiled with ``params`` (a one-line reason), or None if it can.

        Only asked when ``compiles`` is True and the suite asks for ``execution: compiled``.
        """
        return None

    @classmethod
    def eager_error(cls, params: P) -> str | None:
        """Why this decoder cannot run eager with ``params`` (a one-line reason: an option that exists only in
        compiled execution), or None if it can. Asked for every cell of ``execution: eager`` (the plan refuses it).
        """
        return None

    def state_stats(self) -> dict[str, int] | None:
        """The size of the state the decoder built during its last ``generate()`` call, or None (no such state).

        Read by the runner once the sample is measured and stored with it (``samples.step_stats["state"]``):
        e.g. Token Recycling's adjacency matrix bytes, Lookahead's n-gram pool, a retrieval datastore. Keys name
        the quantity with its unit (``*_bytes``, ``*_tokens``, ``*_ngrams``); values are ints.
        """
        return None

    @classmethod
    def corpus_of(cls, params: P) -> CorpusSpec | None:
        """The corpus this configuration retrieves from, or None (the default: no corpus).

        A decoder *declares* its corpus (a :class:`~dtbench.core.CorpusSpec`, usually a ``corpus:`` param); it never
        loads one: the harness loads, holds out and tokenizes the documents and calls :meth:`use_corpus` before the
        first :meth:`generate`, outside the timed region. The default reads a ``corpus`` field of the params.
        Called without models (params only).
        """
        spec = getattr(params, "corpus", None)
        return spec if isinstance(spec, CorpusSpec) else None

    def use_corpus(self, corpus: Corpus) -> None:
        """Receive the documents of the corpus :meth:`corpus_of` declared (token ids, the suite's prompt documents
        left out), after construction and before :meth:`generate`; the default keeps them as ``self.corpus``.

        A decoder that builds an index from them (REST's datastore) overrides this and may cache by ``corpus.key``.
        """
        self.corpus = corpus

    @classmethod
    def verify_sizes(cls, params: P) -> tuple[int, int]:
        """The largest target verifications a configuration can run, in tokens fed to one forward (the pending
        token included): ``(causal, masked)``.

        ``causal``: a forward with plain causal attention (AR steps, chain verification; 0 if it runs none beyond
        the prefill); ``masked``: a forward with an explicit 4D attention mask (tree verification root + nodes,
        StreamingLLM's masked forwards; 0 if it never passes one). Calibration (:mod:`dtbench.harness.calibration.calibrate`)
        measures the forward-latency curves up to these sizes, so a plugin's configurations are priced by the cost
        model; a chain decoder's ``causal - 1`` is its chain length K. Default ``(1, 0)``: one token per forward.
        Called without models (params only).
        """
        return 1, 0

    @classmethod
    def cache_headroom(cls, params: P) -> int:
        """Positions a KV cache (target's or draft's) can hold beyond the committed tokens during one iteration, in
        tokens: what a compiled execution's static caches must leave free (:class:`~dtbench.decoders.static_kv.
        Execution`). Default: the largest of :meth:`verify_sizes`. Called without models (params only)."""
        return max(cls.verify_sizes(params))

    @classmethod
    def compiled_sizes(cls, params: P) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """The forward sizes a configuration runs through compiled execution's static caches after each cache's
        prefill, in new tokens per forward: ``(target's, draft's)``. A compiled cell's compile step compiles the
        buckets holding these sizes and no others (issue 46 item 4: compile time is a budget; on a GPU each bucket
        graph costs tens of seconds).

        ``None`` (the default, for both): every size up to the largest of :meth:`verify_sizes` (safe for any loop);
        ``()``: none (a model this decoder never runs through :class:`~dtbench.decoders.static_kv.StaticKV`, e.g.
        transformers' own compiled forward). A size left out that a sample then uses compiles during that sample and
        is stored as a recompile (``step_stats["compiled"]["recompiles"]``); tests/test_compiled.py holds every
        built-in to zero. Called without models (params only).
        """
        return None, None

    @classmethod
    def compiled_chains(cls, params: P) -> tuple[int, ...]:
        """Draft chain lengths K this configuration runs as one compiled region in compiled execution
        (:func:`~dtbench.decoders.draft_region.draft_chain`, issue 46 item 2): a compiled cell's compile step compiles
        each one's graphs (:func:`~dtbench.decoders.draft_region.precompile_chain`). Default ``()``: none (every draft
        forward runs by itself). Called without models (params only)."""
        return ()

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """The params the conformance kit (:mod:`dtbench.testing`, ``dtbench check``) checks this decoder with: a short
        list of params dicts (each validated by :attr:`Params`), or a hypothesis strategy drawing such dicts.

        Args:
            ctx: a :class:`dtbench.testing.CheckContext`: the tiny seeded target the settings are for (its
                ``config`` sizes a head) and helpers that write what params name (``medusa_head()``,
                ``eagle_head()``, ``token_file()``) into a scratch folder.

        Returns:
            ``[{}]`` by default (the params' own defaults); a decoder whose params have required fields, or whose
            interesting settings are not its defaults, overrides it. Built-ins declare theirs here, exactly as a
            third party does (issue 56 item 2).
        """
        return [{}]

    @classmethod
    def host_reads_bound(cls, params: P, step: Step) -> int | None:
        """The most device-to-host reads (``.item()``, ``.tolist()``, ``bool(t)``, ...; :mod:`dtbench.harness.
        host_reads`) one iteration of this configuration may make, the iteration that committed ``step`` (the
        prefill's first), or None: not declared (the conformance kit reports the counts without judging them).

        On a GPU every read waits for the queued kernels (issue 46 item 1), so a loop that declares a bound is held to
        it by ``dtbench check``'s ``host_reads`` check."""
        return None

    @classmethod
    def reference(cls, params: P) -> tuple[str, dict[str, Any]] | None:
        """The (decoder name, params) whose output this decoder's output is compared against, from the params alone
        (the plan asks before any model loads).

        Greedy full-cache autoregressive decoding (``ar``, the baseline of every speedup:
        :data:`dtbench.harness.measurement.metrics.BASELINE`) by default; a lossy-by-design decoder such as
        StreamingLLM + speculation names its own exact reference. None means "compare with nothing" (the baseline
        itself).
        """
        return ("ar", {})

    @abstractmethod
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Generate ``max_new_tokens`` new tokens, or fewer when ``self.eos_token_id`` is set and EOS comes first.

        Args:
            input_ids: prompt token ids, shape (1, prompt_len), dtype int64, on the target's device.
            max_new_tokens: T, the number of tokens to generate (>= 1); with ``eos_token_id`` set, the most.

        Yields:
            One :class:`Step` per target verification. The committed tokens of all steps, concatenated,
            are the generated continuation; the runner keeps the first T (and nothing after the first EOS when
            ``eos_token_id`` is set, see :func:`cut_at_eos`) and stops iterating then.
        """

    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> Iterator[dict[int, Step]]:
        """Decode B prompts together (batch size B = ``len(prompts)``; only when ``batching`` is True): greedy, or
        sampled when ``batch_sampling`` is True and ``self.sampling`` is set (rows share ``self.generator``).

        Args:
            prompts: per row the prompt ids, shape (1, prompt_len_r) int64 (ragged lengths), on the target's device.
            max_new_tokens: T per row; with ``eos_token_id`` set, the most (a row ends at its first EOS).

        Yields:
            One dict {row index: Step} per target verification (the iteration's committed tokens of each row that
            took part; the first dict holds every row's prefill token). A row's Steps concatenated are its
            continuation; the runner timestamps each dict, keeps each row's first T tokens (cut after EOS) and stops
            once every row is done.

        Raises:
            NotImplementedError: the decoder cannot batch (``batching`` False).
        """
        raise NotImplementedError(f"decoder {type(self).__name__} does not decode batches (batching = False)")


def eos_ids(eos_token_id: int | tuple[int, ...] | list[int] | None) -> frozenset[int]:
    """The set of EOS ids of ``eos_token_id`` (an id, a sequence of ids as in ``generation_config``, or None: empty)."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(t) for t in eos_token_id)


def cut_at_eos(step: Step, eos: frozenset[int]) -> tuple[Step, bool]:
    """``step`` with every token after its first EOS removed, and whether it held an EOS (generation ends then).

    The one place a decoding loop stops at EOS (docs/architecture.md "Decoder contract"): a draft chain or a tree path that
    crosses EOS is cut right after it, so no token after EOS is emitted or counted. ``accepted`` is capped at the
    tokens kept (a cut inside the accepted drafts keeps only drafts and no bonus token); ``drafted``/``depth``
    stay what the target verified.

    Args:
        step: a Step of committed tokens.
        eos: the EOS ids (:func:`eos_ids`); empty: the step is returned unchanged.

    Returns:
        (the step, cut after its first EOS if any; True if it held an EOS).
    """
    end = eos_end(step.tokens, eos)
    if end is None:
        return step, False
    tokens = step.tokens[:end]
    return Step(tokens=tokens, drafted=step.drafted, accepted=min(step.accepted, len(tokens)), depth=step.depth), True


def greedy_token(logits: torch.Tensor) -> int:
    """The greedy (argmax) token of one logits vector, shape (vocab,), any float dtype."""
    return int(torch.argmax(logits, dim=-1).item())


def next_token(logits: torch.Tensor, sampling: SamplingSettings | None, generator: torch.Generator | None) -> int:
    """The greedy token of ``logits`` (shape (vocab,)), or one sampled from ``sampling.probs(logits)``."""
    if sampling is None:
        return greedy_token(logits)
    from dtbench.decoders.sampling import sample

    return sample(sampling.probs(logits), generator)


def first_tokens(
    prompts: list[torch.Tensor],
    first: list[torch.Tensor],
    sampling: SamplingSettings | None,
    generator: torch.Generator | None,
) -> tuple[list[list[int]], list[int]]:
    """(each row's prompt ids, each row's first token) after the prefill: the first iteration's host values.

    Args:
        prompts: per row the prompt ids, shape (1, prompt_len_r), int64, on the device.
        first: per row the prefill's last-position logits, shape (vocab,) (or (1, vocab)).
        sampling, generator: None for greedy decoding; else the first tokens are drawn as :func:`next_token` draws.

    Greedy: ONE device-to-host read for both (the prompts' ids and the rows' argmaxes concatenated; issue 46, at
    most one read per iteration, the prefill's included). Sampling: the prompts read, each first token drawn.
    """
    if sampling is not None:
        return [p[0].tolist() for p in prompts], [next_token(lg, sampling, generator) for lg in first]
    lengths = [int(p.shape[-1]) for p in prompts]
    heads = [torch.argmax(lg.reshape(-1), dim=-1).view(1).to(prompts[0].dtype) for lg in first]
    packed = torch.cat([*(p[0] for p in prompts), *heads]).tolist()
    texts, at = [], 0
    for n in lengths:
        texts.append(packed[at : at + n])
        at += n
    return texts, packed[at:]


def verify_chain_read(drafts: list[int] | torch.Tensor, logits: torch.Tensor) -> tuple[int, tuple[int, ...], list[int]]:
    """:func:`verify_chain` over drafts that may still be on the device, with ONE device-to-host read.

    Args:
        drafts: K drafted token ids: a list, or a 1-D int64 tensor on the logits' device (device-resident drafts,
            issue 46: a chain's K draft tokens are never read one by one).
        logits: target logits over [pending, *drafts], shape (K + 1, vocab).

    Returns:
        (accepted, committed, drafts as a list): :func:`verify_chain`'s pair and the drafts read back, all from one
        read of the target's K + 1 greedy tokens and the K drafts.
    """
    predicted = torch.argmax(logits, dim=-1)
    if torch.is_tensor(drafts):
        k = int(drafts.shape[0])
        packed = torch.cat([predicted, drafts.to(predicted.dtype)]).tolist()  # the iteration's one read
        pred, host = packed[: k + 1], packed[k + 1 :]
    else:
        pred, host = predicted.tolist(), list(drafts)
    accepted = 0
    while accepted < len(host) and host[accepted] == pred[accepted]:
        accepted += 1
    return accepted, (*host[:accepted], pred[accepted]), host


def verify_chain(drafts: list[int], logits: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Greedy verification of a draft chain (Leviathan et al. 2023, greedy case; paper section 4.3).

    Args:
        drafts: K drafted token ids.
        logits: target logits over [pending, *drafts], shape (K + 1, vocab); row i predicts the token after input i.

    Returns:
        (accepted, committed): the length of the longest draft prefix equal to the target's greedy tokens, and
        the committed tokens = that prefix plus the target's bonus token (1 <= len(committed) <= K + 1).
    """
    accepted, committed, _ = verify_chain_read(drafts, logits)
    return accepted, committed
