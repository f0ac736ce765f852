"""transformers' own assisted generation as a benchmarked decoder (paper section 4.3, "HuggingFace Assisted
Generation"; Table 1).

``target.generate(input_ids, assistant_model=draft, do_sample=False, ...)`` runs the whole loop inside one
blocking call, and dtbench runs it as a user calls it: in the measuring thread, to completion. A streamer
(:class:`_Commits`) records each target verification as it happens: in transformers 5.x
``GenerationMixin._assisted_decoding`` calls ``streamer.put(valid_tokens)`` exactly once per target forward (after
selecting the matching candidates plus the bonus token), and once beforehand with the prompt, which is skipped.
``put`` reads the runner's clock after synchronizing the device (:func:`~dtbench.decoders.base.commit_clock`) and
keeps (time, tokens, drafted); when the call returns, one Step per verification is yielded carrying that commit time
(``Step.at``). The one timing loop (:func:`dtbench.harness.measurement.measure.measure_rows`) takes a Step's time and the forwards
counted up to it from ``at``, so iteration i's time is exactly the time between verification i-1's tokens and
verification i's, as for every pull-based decoder (issue 47: a push-based decoder measured by the same loop).

History: version 1 ran ``generate`` in a worker thread, whose forwards on the embedded CPU pair took 20-30% longer
(a second OpenMP thread team: draft step 37.9 -> 48.6 ms); version 2 ran it in a greenlet of the measuring thread,
switching C stacks at every ``put``, which segfaulted on CUDA (an H200: after another decoder, and alone after one
prompt, in ``update_candidate_strategy``; issues 38 and 47). Version 3 has neither: every forward runs in the
measuring thread, on its own stack, with nothing interleaved.

The number of drafted tokens per iteration (``candidate_length`` in transformers) is read by wrapping the
candidate generator's ``get_candidates`` for the duration of the call (through the private
``GenerationMixin._get_candidate_generator``; present throughout transformers 4.3x-5.x). Accepted drafts are
``len(tokens) - 1``: the candidates are capped below the length budget, so the bonus token is never cut off.

The assistant's settings that changed defaults between transformers releases (``num_assistant_tokens``,
``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``) are explicit parameters. For the call the
draft model's ``generation_config`` is replaced by a clean one holding only them (and no EOS), and the original
object is put back afterwards: every result names what ran, a "heuristic" schedule does not carry its adapted
value from one prompt to the next (transformers would persist it on the assistant's config), and the draft
neither stops at EOS nor has EOS suppressed (the assistant's generate() otherwise takes EOS from the draft's
own config and, since the call asks for exactly T tokens, forbids it: drafts then always miss where the target
predicts EOS). Generation settings that would make the target's choice non-greedy (repetition penalties,
banned n-grams, forced or suppressed tokens) are forced off.

Environment dependence: with ``assistant_confidence_threshold > 0`` and scikit-learn importable, transformers
re-fits that threshold during the call from the draft's acceptance history (ROC cost minimisation); without
scikit-learn it stays fixed. Results are only comparable between environments that agree on this.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from pydantic import Field
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from dtbench.decoders.base import Decoder, DecoderParams, Step, commit_clock, cut_at_eos, eos_ids

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    class GenerativeModel(PreTrainedModel, GenerationMixin):
        """What the decoders' target and draft are: a transformers causal LM (a ``PreTrainedModel`` with
        ``generate``), for the type checker only."""


_ASSISTANT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")

# Generation settings forced to their neutral value, so that a model's own generation_config cannot turn greedy
# decoding into something else (repetition penalties, banned n-grams, forced or suppressed tokens).
_NEUTRAL = dict(
    repetition_penalty=None,
    no_repeat_ngram_size=None,
    bad_words_ids=None,
    suppress_tokens=None,
    begin_suppress_tokens=None,
    forced_bos_token_id=None,
    forced_eos_token_id=None,
    sequence_bias=None,
    encoder_repetition_penalty=None,
    encoder_no_repeat_ngram_size=None,
    renormalize_logits=None,
    temperature=None,
    top_k=None,
    top_p=None,
    min_p=None,
    typical_p=None,
    epsilon_cutoff=None,
    eta_cutoff=None,
)


class HFAssistedParams(DecoderParams):
    """Assistant settings of transformers' assisted generation (explicit, so a result names exactly what ran).

    Attributes:
        num_assistant_tokens: draft tokens proposed per iteration at the start of the call (transformers 5.x
            default 20; 4.3x defaulted to 5).
        num_assistant_tokens_schedule: "constant" keeps it fixed (5.x default); "heuristic" adds 2 after a fully
            accepted draft and subtracts 1 (min 1) otherwise (4.3x default); "heuristic_transient" is the same. Both
            heuristics restart from ``num_assistant_tokens`` on every prompt here.
        assistant_confidence_threshold: the draft stops early when its top-1 probability falls below this
            (5.x default 0.4; 0 disables).
    """

    num_assistant_tokens: int = Field(20, ge=1, le=256, description="draft tokens per iteration (initial)")
    num_assistant_tokens_schedule: Literal["constant", "heuristic", "heuristic_transient"] = Field(
        "constant", description="how num_assistant_tokens adapts during the call"
    )
    assistant_confidence_threshold: float = Field(
        0.4, ge=0.0, lt=1.0, description="draft stops below this top-1 probability (0 disables)"
    )


class _Commits(BaseStreamer):
    """Streamer of the ``generate`` call: records each verification's (commit time, committed ids, drafted).

    ``put`` is called by transformers in the measuring thread right after a verification's tokens are selected; it
    reads :func:`~dtbench.decoders.base.commit_clock` (the runner's clock after synchronizing ``device``) and keeps
    ``(seconds, int64 CPU tensor of committed ids, drafted)`` in :attr:`commits`. The first ``put`` (the prompt) is
    skipped. ``drafted`` is set by the candidate-generator wrapper (:func:`_counting_candidates`) before each ``put``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.drafted = 0
        self.commits: list[tuple[float, torch.Tensor, int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        at = commit_clock(self.device)
        self.commits.append((at, value.detach().to("cpu", copy=True), self.drafted))

    def end(self) -> None:
        pass


class _StreamedGenerate(Decoder):
    """A transformers ``generate`` call run to completion in the measuring thread, one Step per streamer ``put``,
    each carrying its commit time (``Step.at``; see module doc).

    Subclasses give the call's extra keyword arguments (:meth:`_generate_kwargs`) and may wrap the call
    (:meth:`_around_call`, a context manager) to install and remove hooks.
    """

    # 3: generate() runs in the measuring thread to completion, Steps stamped by the streamer (issue 47); version 2
    # ran it in a greenlet switching at every put (it segfaulted on CUDA), version 1 in a worker thread (20-30% slower
    # forwards on CPU). Version 3 times an iteration from one verification's tokens to the next, without the runner's
    # own bookkeeping between two Steps that versions 1-2 charged to the next iteration.
    version = "3"

    def _generate_kwargs(self, bridge: _Commits, batch: int) -> dict:
        return {}

    def _around_call(self, bridge: _Commits):
        from contextlib import nullcontext

        return nullcontext()

    def _step(self, tokens: tuple[int, ...], drafted: int) -> Step:
        return Step(tokens=tokens)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Run ``target.generate`` in this thread to completion, then yield one Step per streamer put, each with its
        commit time (``Step.at``).

        Args:
            input_ids: prompt ids, shape (1, prompt_len), int64, on the target's device.
            max_new_tokens: T; exactly T tokens are generated (EOS ignored), or with ``eos_token_id`` set, T at
                most: generate() stops at EOS itself and a verification that accepted tokens past EOS is cut
                after it (:func:`~dtbench.decoders.base.cut_at_eos`), which ends the Steps.

        Raises:
            Whatever ``generate`` raised.
        """
        bridge = _Commits(input_ids.device)
        self._work(bridge, input_ids, max_new_tokens)
        eos = eos_ids(self.eos_token_id)
        for at, payload, drafted in bridge.commits:
            step, ended = cut_at_eos(self._stamped(tuple(payload.view(-1).tolist()), drafted, at), eos)
            yield step
            if ended:
                return

    def _stamped(self, tokens: tuple[int, ...], drafted: int, at: float) -> Step:
        """:meth:`_step` with its commit time."""
        step = self._step(tokens, drafted)
        return Step(step.tokens, step.drafted, step.accepted, step.depth, at)

    def _batch_pad(self) -> int:
        target = cast("GenerativeModel", self.target)
        pad = target.generation_config.pad_token_id
        if pad is None:
            pad = getattr(target.config, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> Iterator[dict[int, Step]]:
        """B prompts in ONE transformers ``generate`` call (left-padded, with the attention mask: transformers' own
        batched greedy decoding, AR's peer at the same B); one dict {row: Step} per streamer put.

        Rows that reached EOS keep receiving transformers' padding until every row is done (its loop costs them
        as it does); the runner ignores a row's steps after its EOS.
        """
        b, width = len(prompts), max(p.shape[-1] for p in prompts)
        dev = prompts[0].device
        ids = torch.full((b, width), self._batch_pad(), dtype=torch.long, device=dev)
        mask = torch.zeros((b, width), dtype=torch.long, device=dev)
        for r, p in enumerate(prompts):
            n = p.shape[-1]
            ids[r, width - n :], mask[r, width - n :] = p[0], 1
        bridge = _Commits(dev)
        self._work(bridge, ids, max_new_tokens, mask)
        for at, payload, drafted in bridge.commits:
            rows = payload.view(b, -1)
            yield {r: self._stamped(tuple(rows[r].tolist()), drafted, at) for r in range(b)}

    def _work(
        self, bridge: _Commits, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None
    ) -> None:
        """The call: generate() of exactly T tokens (EOS ignored; with ``eos_token_id``, up to T, stopping
        at EOS) with the subclass's settings."""
        target = cast("GenerativeModel", self.target)
        pad = target.generation_config.pad_token_id
        if pad is None:
            pad = getattr(target.config, "pad_token_id", None)
        if pad is None:
            pad = 0
        settings = dict(_NEUTRAL, do_sample=False)
        stop = None if self.eos_token_id is None else sorted(eos_ids(self.eos_token_id))
        if self.sampling is not None:
            # transformers samples from the global torch RNG: seed it from this sample's own generator, so a
            # seeded run is reproducible (the only global RNG use in dtbench, inside this call).
            torch.manual_seed(self.generator.initial_seed() if self.generator is not None else 0)
            settings.update(
                do_sample=True,
                temperature=self.sampling.temperature,
                top_k=self.sampling.top_k or None,
                top_p=self.sampling.top_p,
            )
        with self._around_call(bridge):
            target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
                num_beams=1,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if stop is None else None,
                eos_token_id=stop,
                pad_token_id=pad,
                streamer=bridge,
                **settings,
                **self._generate_kwargs(bridge, int(input_ids.shape[0])),
            )


class HFGenerateParams(DecoderParams):
    """transformers' ``generate`` (greedy or sampled, penalties off): plain decoding by default; with
    ``prompt_lookup_num_tokens``, transformers' own prompt lookup decoding (``PromptLookupCandidateGenerator``),
    the peer of the built-in ``ngram`` (issue 22).

    Attributes:
        prompt_lookup_num_tokens: candidate tokens copied after an n-gram match per iteration (None: plain
            decoding, one Step per token).
        max_matching_ngram_size: longest n-gram matched (transformers' default, 2, when None).
    """

    prompt_lookup_num_tokens: int | None = Field(
        None,
        ge=1,
        le=128,
        description="transformers' prompt lookup: candidate tokens per iteration (None: plain generate)",
    )
    max_matching_ngram_size: int | None = Field(
        None, ge=1, le=64, description="prompt lookup's longest n-gram (None: transformers' default, 2)"
    )


class HFGenerate(_StreamedGenerate):
    """transformers' own greedy ``generate()``: one Step per token, so "is our ``ar`` as fast as transformers'?"
    is a row of any suite (paper section 4.3's AR baseline, on transformers' stack).

    The first Step includes the prefill. Lossless: its output equals ``ar``'s.
    """

    Params = HFGenerateParams
    needs_draft = False
    lossless = True
    supports_sampling = True  # generate(do_sample=True, temperature, top_k, top_p): the reference for ar's sampling
    family = "external"  # transformers' own decoding loop
    batching = True  # plain generate over a left-padded batch (prompt lookup: batch size 1 only, batching_error)
    compiles = True  # transformers' static cache + its compiled decoding forward (the reference implementation)

    @classmethod
    def compile_error(cls, params: HFGenerateParams) -> str | None:
        """transformers' prompt lookup decoding verifies candidates of varying length: it cannot run compiled."""
        if params.prompt_lookup_num_tokens is not None:
            return "transformers' prompt lookup decoding (prompt_lookup_num_tokens) cannot run compiled"
        return None

    @classmethod
    def compiled_sizes(cls, params: HFGenerateParams) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """None through dtbench's static caches: transformers compiles its own decoding forward (the cell's compile
        step runs it once, :meth:`~dtbench.harness.measurement.hardware.Hardware.compile_step`)."""
        return (), ()

    @classmethod
    def batching_error(cls, params: HFGenerateParams) -> str | None:
        """transformers' prompt lookup decoding takes one sequence at a time."""
        if params.prompt_lookup_num_tokens is not None:
            return "transformers' prompt lookup decoding (prompt_lookup_num_tokens) decodes batch size 1 only"
        return None

    def _lookup(self) -> bool:
        return self.params.prompt_lookup_num_tokens is not None

    def _generate_kwargs(self, bridge: _Commits, batch: int) -> dict:
        if not self._lookup():
            return self._compiled_kwargs(batch)
        p = self.params
        extra = {} if p.max_matching_ngram_size is None else {"max_matching_ngram_size": p.max_matching_ngram_size}
        return {"prompt_lookup_num_tokens": p.prompt_lookup_num_tokens, **extra}

    def _compiled_kwargs(self, batch: int) -> dict:
        """In compiled execution (:func:`dtbench.decoders.static_kv.compiled`): transformers' own recipe, a static cache
        (the execution's pooled one for ``batch`` rows, reset, so every prompt compiles to the same shapes: a pooled
        cache's batch size is fixed by its first call, so one process running B = 1 then B = 3 draws two; found by the
        kit's B = 3 leg, issue 59 item 6, where B = 3 failed in index_copy_ on the B = 1 cache) and ``compile_config``
        (``torch.compile`` of the decoding forward; ``mode="reduce-overhead"`` on CUDA, inductor's default on CPU,
        which transformers compiles only when asked: ``_compile_all_devices``). Eager: nothing."""
        from dtbench.decoders import modelinfo, static_kv

        execution = static_kv.current()
        if execution is None:
            return {}
        from transformers import CompileConfig

        cache = execution.static_cache(self.target, owner="transformers" + static_kv.batch_owner(batch))
        cache.reset()
        cache.dtbench_length = 0  # kept by static_kv.hooks_outside_compiled: the KV positions, read without a sync
        cuda = self.target.device.type == "cuda"
        config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead" if cuda else "default")
        # transformers' switch for compiling on devices other than CUDA (declared "= None", so typed as None)
        config._compile_all_devices = True  # type: ignore[assignment]
        return {modelinfo.cache_keyword(self.target): cache, "compile_config": config}

    def _step(self, tokens: tuple[int, ...], drafted: int) -> Step:
        if not self._lookup():
            return Step(tokens=tokens)
        return Step(tokens=tokens, drafted=drafted, accepted=len(tokens) - 1, depth=drafted)

    def _around_call(self, bridge: _Commits):
        from dtbench.decoders import static_kv

        target = cast("GenerativeModel", self.target)
        if self._lookup():
            return _counting_candidates(target, bridge)
        if static_kv.current() is not None:
            return static_kv.hooks_outside_compiled(target)
        return super()._around_call(bridge)


class HFAssisted(_StreamedGenerate):
    """transformers' assisted generation (``generate(..., assistant_model=draft)``), greedy, EOS ignored.

    Each Step is one target verification: the tokens transformers committed in it (matched candidates plus
    the target's bonus token), ``drafted`` = candidates proposed, ``accepted`` = ``len(tokens) - 1``. The first
    Step therefore includes the prefill and the first verification. Lossless: in fp32/fp64 its output equals
    ``ar`` (transformers compares argmaxes in float32, so a float64 model can differ only on float32 ties).

    Raises:
        ValueError: (constructor) without a draft model.
    """

    Params = HFAssistedParams
    needs_draft = True
    lossless = True

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """transformers' defaults, and 4 candidates with a confidence threshold."""
        return [{}, {"num_assistant_tokens": 4, "assistant_confidence_threshold": 0.4}]

    supports_sampling = True  # transformers' assisted generation samples with speculative sampling
    family = "external"  # transformers' own loop: its draft length schedule is transformers', not a fixed K

    @classmethod
    def verify_sizes(cls, params: HFAssistedParams) -> tuple[int, int]:
        """(up to 2 n + 1, 0) causal tokens, at most 64: transformers' heuristic schedule grows the draft length
        n (``num_assistant_tokens``) by 2 per fully accepted iteration."""
        return min(2 * params.num_assistant_tokens + 1, 64), 0

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """One Step per target verification (see :class:`_StreamedGenerate`).

        Raises:
            RuntimeError: if this transformers version lacks the candidate-generator hook.
        """
        if not hasattr(type(self.target), "_get_candidate_generator"):
            raise RuntimeError(
                "this transformers version has no GenerationMixin._get_candidate_generator; hf_assisted cannot "
                "count drafted tokens per iteration"
            )
        yield from super().generate(input_ids, max_new_tokens)

    def _step(self, tokens: tuple[int, ...], drafted: int) -> Step:
        return Step(tokens=tokens, drafted=drafted, accepted=len(tokens) - 1, depth=drafted)

    def _generate_kwargs(self, bridge: _Commits, batch: int) -> dict:
        return {"assistant_model": self.draft}

    @contextmanager
    def _around_call(self, bridge: _Commits):
        """Count candidates per iteration and give the draft a clean generation config, both undone afterwards."""
        target = cast("GenerativeModel", self.target)
        draft = cast("GenerativeModel", self.draft)  # never None: needs_draft (Decoder.__init__ refuses None)
        saved_config = draft.generation_config
        pad = target.generation_config.pad_token_id
        pad = pad if pad is not None else getattr(target.config, "pad_token_id", None) or 0
        try:
            # The assistant's generate() fills every setting its caller left unset from the *draft's*
            # generation_config: a clean one (EOS unset, so drafts neither stop at nor suppress EOS; no penalties)
            # holding only the assistant settings, swapped in for the call.
            draft.generation_config = GenerationConfig(
                **{name: getattr(self.params, name) for name in _ASSISTANT_SETTINGS},
                eos_token_id=None,
                pad_token_id=pad,
                do_sample=False,
                num_beams=1,
            )
            with _counting_candidates(target, bridge), _quiet_assistant_call():
                yield
        finally:
            draft.generation_config = saved_config


class _AssistantDeprecation(logging.Filter):
    """Drops transformers' "Passing `generation_config` together with generation-related arguments" warning, which
    its own ``AssistedCandidateGenerator._generate_candidates`` triggers (``assistant_model.generate(**generation_args,
    **assistant_kwargs)``, transformers 5.x ``generation/candidate_generator.py``): dtbench's call passes no
    ``generation_config``, so the user cannot act on it. Every other message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Passing `generation_config` together with generation-related")


@contextmanager
def _quiet_assistant_call():
    """For the call: :class:`_AssistantDeprecation` on transformers' generation logger, removed afterwards."""
    log = logging.getLogger("transformers.generation.utils")
    quiet = _AssistantDeprecation()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


@contextmanager
def _counting_candidates(target: GenerativeModel, bridge: _Commits):
    """For the call: wrap the candidate generator's ``get_candidates`` so ``bridge.drafted`` holds each iteration's
    candidate count (assisted generation and prompt lookup alike); the wrapper is removed afterwards."""
    original = type(target)._get_candidate_generator

    def get_candidate_generator(*args, **kwargs):
        generator = original(target, *args, **kwargs)  # type: ignore[arg-type]  # the model, as transformers calls it
        inner = generator.get_candidates

        def get_candidates(ids, *a, **kw):
            candidates, logits = inner(ids, *a, **kw)
            bridge.drafted = candidates.shape[1] - ids.shape[1]
            return candidates, logits

        generator.get_candidates = get_candidates  # type: ignore[method-assign,assignment]  # wrapped for the call
        return generator

    try:
        target.__dict__["_get_candidate_generator"] = get_candidate_generator  # instance attribute shadows the method
        yield
    finally:
        target.__dict__.pop("_get_candidate_generator", None)
