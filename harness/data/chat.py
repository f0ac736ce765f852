"""Chat prompts for question datasets: templates, multi-turn questions, and turn t's prompt from the reference's answers.

A suite's ``chat_template`` decides how a question becomes token ids (:func:`render`):

- ``auto``: the target tokenizer's own template, ``tokenizer.apply_chat_template(messages,
  add_generation_prompt=True)`` (the embedded SmolLM2-135M-Instruct has one); a tokenizer without a template is a
  one-line error naming the model (:func:`template_text`, checked at validate time).
- ``none``: no template: the turns (and answers) joined by blank lines, encoded as raw text.
- a path: a Jinja chat template file (transformers' format), applied with ``apply_chat_template(chat_template=...)``;
  ``suites/templates/vicuna.jinja`` is FastChat's ``vicuna_v1.1`` conversation, Spec-Bench's setting for Vicuna.

Templates are untrusted text: transformers renders them in Jinja's sandbox, and dtbench bounds each rendering
(:func:`render`): at most :data:`RENDER_SECONDS` seconds (a ``SIGALRM`` timer, in the main thread, where validate,
the run's preflight and every turn's rendering happen) and :data:`RENDER_CHARS` characters beyond twice the
messages' own text (the output is streamed, so a template repeating a long string stops at the bound instead of
exhausting memory). A template that raises (``raise_exception``, a sandbox refusal, an undefined name), runs too
long, grows too large or renders an empty prompt is one line naming the template (:class:`PromptFailed`);
``validate`` and ``run`` render every prompt of the suite's questions before any model loads
(:func:`dtbench.harness.data.questions.check_prompts`), later turns with a placeholder answer.

``system_prompt`` adds a system message first. The default template is ``auto`` for question datasets
(:attr:`dtbench.harness.data.datasets.Dataset.chat`); the run records the template, the system prompt and the template's
sha256 in its environment (:func:`describe`).

Multi-turn questions run as Spec-Bench's and MT-bench's ``gen_model_answer`` do: turn t's prompt is the chat of turns
1..t with the assistant's earlier answers, here the **reference decoder's** answers (decoded from its stored output,
special tokens skipped), so every decoder is timed on the same turn-t prompt (:func:`resolve`). A prompt longer than
L_max keeps its last L_max tokens (the end holds the question and the generation prompt).
"""

from __future__ import annotations

import hashlib
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.safetext import printable
from dtbench.harness.suites.bounds import MAX_SUITE_BYTES, read_regular_file

RENDER_SECONDS = 5.0  # one prompt's rendering (a chat template renders in milliseconds)
RENDER_CHARS = 1 << 20  # characters a template may add to a prompt beyond twice its messages' own text


class TurnNotReady(DtbenchError):
    """A later turn's prompt cannot be rendered: the reference's answer to an earlier turn is not stored (not measured
    yet on another worker, or its cell failed). Executors retry the group later, or fail its cells with this."""


class PromptFailed(DtbenchError):
    """The chat template failed on a prompt: it raised, ran past :data:`RENDER_SECONDS`, grew past its size bound
    or rendered no tokens. Before the run (validate, preflight, turn 1) it is the one-line error; for a later turn
    (rendered with the reference's answers when dispatched) executors fail that prompt's cells with it."""


class _Expired(Exception):
    """Raised by the SIGALRM handler of :func:`_time_bound` inside the rendering it interrupts."""


@contextmanager
def _time_bound(seconds: float) -> Iterator[None]:
    """Interrupt the body with :class:`_Expired` after ``seconds`` (an interval timer and SIGALRM: the main thread
    of a POSIX process, and only while no other timer is set; elsewhere the body runs unbounded in time, its
    output still bounded in size)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "setitimer")
        or signal.getitimer(signal.ITIMER_REAL)[0] > 0
    ):
        yield
        return

    def expire(signum, frame):
        raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _bounded_render(template: str, chat: list[dict[str, str]], tokenizer, limit: int) -> str:
    """The template's text for ``chat`` as transformers renders it (its sandboxed, compiled template; the
    tokenizer's special tokens as variables), streamed chunk by chunk so it stops past ``limit`` characters.

    Raises:
        PromptFailed: more than ``limit`` characters. Anything the template raises propagates.
    """
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(template)
    parts, size = [], 0
    for chunk in compiled.generate(
        messages=chat, tools=None, documents=None, add_generation_prompt=True, **dict(tokenizer.special_tokens_map)
    ):
        size += len(chunk)
        if size > limit:
            raise PromptFailed(f"renders more than {limit:,} characters")
        parts.append(chunk)
    return "".join(parts)


def template_text(mode: str, tokenizer, model_name: str) -> str | None:
    """The Jinja template ``mode`` stands for: None for ``none``, the tokenizer's own for ``auto``, a file's text.

    Raises:
        DtbenchError: ``auto`` with a tokenizer that has no chat template (naming the model), or an unreadable file.
    """
    if mode == "none":
        return None
    if mode == "auto":
        text = getattr(tokenizer, "chat_template", None)
        if not text:
            raise DtbenchError(
                f"model '{model_name}' has no chat template (chat_template: auto); set chat_template: "
                f"none or the path of a template file"
            )
        return text if isinstance(text, str) else str(text)
    try:  # a regular file of at most 1 MiB: chat_template: /dev/zero is an error, not a hang
        text = read_regular_file(Path(mode).expanduser(), MAX_SUITE_BYTES, what="chat template").decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DtbenchError(
            f"chat_template: cannot read {clip(mode, 200)} ({getattr(exc, 'strerror', None) or type(exc).__name__})"
        ) from None
    if not text.strip():
        raise DtbenchError(f"chat_template: {clip(mode, 200)} is empty (it would render empty prompts)")
    return text


def describe(mode: str, template: str | None, system_prompt: str | None) -> dict[str, Any]:
    """What the run records about its chat prompts: the setting, the system prompt, the template's sha256."""
    return {
        "chat_template": mode,
        "system_prompt": system_prompt,
        "template_sha256": hashlib.sha256(template.encode()).hexdigest() if template is not None else None,
    }


def messages(turns: list[str], answers: list[str], system_prompt: str | None) -> list[dict[str, str]]:
    """The chat of ``turns`` (user) interleaved with ``answers`` (assistant; one fewer than the turns)."""
    out = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for i, turn in enumerate(turns):
        out.append({"role": "user", "content": turn})
        if i < len(answers):
            out.append({"role": "assistant", "content": answers[i]})
    return out


def render(
    tokenizer, template: str | None, turns: list[str], answers: list[str], system_prompt: str | None, name: str = ""
) -> list[int]:
    """Token ids of the prompt for the last of ``turns``, ending with the generation prompt.

    Args:
        tokenizer: the target's tokenizer.
        template: :func:`template_text`'s result (None: no template, the texts joined by blank lines).
        turns: the user turns so far; answers: the assistant's answers to all but the last.
        system_prompt: a system message, or None.
        name: the template's name in errors (the suite's ``chat_template`` setting).

    Returns:
        Token ids, ``apply_chat_template(messages, chat_template=template, add_generation_prompt=True)``.

    Raises:
        PromptFailed: the template raised, ran past :data:`RENDER_SECONDS`, rendered more than :data:`RENDER_CHARS`
            characters beyond twice the messages' text, or the prompt has no tokens (one line naming the template).
    """
    where = f"chat_template {printable(clip(name or 'auto', 120))}"
    if template is None:
        parts = ([system_prompt] if system_prompt else []) + [
            x for pair in zip(turns, [*answers, None]) for x in pair if x is not None
        ]
        ids = list(tokenizer.encode("\n\n".join(parts)))
    else:
        chat = messages(turns, answers, system_prompt)
        limit = RENDER_CHARS + 2 * sum(len(m["content"]) for m in chat)
        try:
            with _time_bound(RENDER_SECONDS):
                _bounded_render(template, chat, tokenizer, limit)  # raises, hangs or grows here, within bounds
                out = tokenizer.apply_chat_template(
                    chat, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=True
                )
        except _Expired:
            raise PromptFailed(f"{where}: rendering one prompt took longer than {RENDER_SECONDS:g} s") from None
        except PromptFailed as exc:
            raise PromptFailed(f"{where}: {exc}") from None
        except MemoryError:
            raise PromptFailed(f"{where}: rendering one prompt ran out of memory") from None
        except Exception as exc:  # noqa: BLE001  (TemplateError, SecurityError, anything a template raises)
            raise PromptFailed(f"{where}: {type(exc).__name__}: {printable(clip(exc, 200))}") from None
        ids = list(out["input_ids"])
    if not ids:
        raise PromptFailed(f"{where}: the prompt is empty (0 tokens)")
    return ids


@dataclass(frozen=True)
class Renderer:
    """How one question entry's prompts are rendered: the tokenizer, template, system prompt and L_max."""

    tokenizer: Any
    template: str | None
    system_prompt: str | None
    l_max: int
    name: str = ""

    def ids(self, turns: list[str], answers: list[str]) -> tuple[int, ...]:
        """The prompt's last ``l_max`` token ids (:func:`render`; raises :class:`PromptFailed`)."""
        ids = render(self.tokenizer, self.template, turns, answers, self.system_prompt, self.name)
        return tuple(ids[-self.l_max :])

    def answer(self, tokens: list[int]) -> str:
        """The text of a stored answer (special tokens, EOS included, skipped; stripped as FastChat strips it)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()


class ChatPrompts(list):
    """The prompts of one (question entry, L_max), in prompt-index order, with the renderer of later turns."""

    def __init__(self, prompts, renderer: Renderer, questions: dict[int, tuple[str, ...]]):
        super().__init__(prompts)
        self.renderer = renderer
        self.questions = questions  # prompt index -> the question's turns


def resolve(prompts: list, index: int, reference_output: Callable[[int], list[int] | None]):
    """The prompt at ``index``, with a later turn's token ids rendered from the reference's earlier answers.

    Args:
        prompts: a :class:`ChatPrompts` (any other list is returned from as it is).
        index: the prompt index.
        reference_output: the reference decoder's stored output tokens for a prompt index, or None if not stored.

    Raises:
        TurnNotReady: an earlier turn's reference answer is not stored (its cell failed, or it has not run yet).
    """
    prompt = prompts[index]
    turn = getattr(prompt, "turn", None)
    if not isinstance(prompts, ChatPrompts) or not turn or turn == 1 or prompt.token_ids:
        return prompt
    answers = []
    for back in range(turn - 1, 0, -1):
        tokens = reference_output(index - back)
        if tokens is None:
            raise TurnNotReady(
                f"question {prompt.question_id} turn {turn}: the reference decoder's answer to turn "
                f"{turn - back} (prompt {index - back}) is not stored, so turn {turn} has no prompt"
            )
        answers.append(prompts.renderer.answer(tokens))
    turns = list(prompts.questions[index][:turn])
    resolved = replace(prompt, token_ids=prompts.renderer.ids(turns, answers))
    prompts[index] = resolved
    return resolved


def suite_template(suite, tokenizer) -> tuple[str, str | None]:
    """(the suite's chat_template setting for question datasets, default ``auto``; its template text).

    Raises:
        DtbenchError: see :func:`template_text`.
    """
    mode = suite.chat_template or "auto"
    return mode, template_text(mode, tokenizer, suite.target.model)
