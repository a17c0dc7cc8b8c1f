"""Prompts rendered and tokenised: the user turn (the problem and ``data.instruction``), wrapped per
``data.template`` (``TEMPLATES``) with ``data.system_prompt``, encoded without special tokens.

By default the template is the tokenizer's chat template when it has one. For DeepSeek-R1-Distill-Qwen that gives
``<｜begin▁of▁sentence｜><｜User｜>{problem}<｜Assistant｜><think>\n``, as ``r1`` does for any tokenizer with those
tokens: the prompt already opens the thought, which is why a DeepMath ``r1_solution_*`` trace (no opening
``<think>``, one ``</think>``, then the written solution) is the SFT target as it is (``data``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lspo_jax import options
from lspo_jax.tasks.data_report import DataError
from lspo_jax.tasks.text import error_cause
from lspo_jax.train_config import DataConfig


def prompt_text(problem: str, config: DataConfig) -> str:
    """The user turn: the problem with the instruction after or before it (one newline between), or alone."""
    if config.instruction_position == "none" or not config.instruction:
        return problem
    if config.instruction_position == "before":
        return f"{config.instruction}\n{problem}"
    return f"{problem}\n{config.instruction}"


def render_prompt(tokenizer: Any, text: str, config: DataConfig | None = None) -> list[int]:
    """Prompt token ids of one user turn ``text`` per ``config``'s template and system prompt (None: the
    tokenizer's chat template when it has one, else BOS + the text; no system prompt).

    The prompt is rendered to text and then encoded without special tokens, since the template writes its own BOS
    (the way transformers tokenizes a rendered chat).
    """
    return render_prompts(tokenizer, [text], config)[0]


def render_texts(tokenizer: Any, texts: Sequence[str], config: DataConfig | None = None) -> list[str]:
    """The prompts as text, one per user turn in ``texts``, per ``data.template`` and ``data.system_prompt``
    (``config`` None: the generated tasks' own format, the tokenizer's template and no system prompt)."""
    template, system = ("tokenizer", None) if config is None else (config.template, config.system_prompt)
    if template == "tokenizer" and not getattr(tokenizer, "chat_template", None):
        template = "plain"
    return TEMPLATES.resolve(template)(tokenizer, texts, system)


TEMPLATES = options.Registry(options.PromptTemplate, "prompt template")


@TEMPLATES.register("tokenizer")
def _chat_template(tokenizer: Any, texts: Sequence[str], system: str | None) -> list[str]:
    """The tokenizer's own chat template: a system turn (when set), the user turn, the generation prompt."""
    import jinja2

    head = [{"role": "system", "content": system}] if system else []
    try:
        rendered = [
            tokenizer.apply_chat_template([*head, {"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=False)
            for text in texts
        ]  # fmt: skip
    except (jinja2.TemplateError, ValueError) as err:  # a template that refuses a system turn raises
        raise DataError(f"data.template: the tokenizer's chat template failed ({error_cause(err)}); set "
                        "data.template: r1 or plain, or data.system_prompt: null") from err  # fmt: skip
    # A template written for user turns alone (some ports of R1's) drops a system turn without a word.
    if system and rendered and system.strip() not in rendered[0]:
        raise DataError("data.system_prompt: the tokenizer's chat template leaves the system turn out; set "
                        "data.template: r1 or plain, or data.system_prompt: null")  # fmt: skip
    return rendered


# DeepSeek-R1-Distill's markup; its chat template puts a system prompt right after BOS, with no separator.
R1_BOS, R1_USER, R1_ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


@TEMPLATES.register("r1")
def _r1_template(tokenizer: Any, texts: Sequence[str], system: str | None) -> list[str]:
    """``<｜begin▁of▁sentence｜>{system}<｜User｜>{text}<｜Assistant｜><think>`` and a newline, as DeepSeek-R1-Distill's
    template renders one turn; each of its three marks must be one token of the tokenizer, not text."""
    marks = (R1_BOS, R1_USER, R1_ASSISTANT)
    lacking = [mark for mark, ids in zip(marks, encode_texts(tokenizer, marks), strict=True) if len(ids) != 1]
    if lacking:
        raise DataError(f"data.template: r1 needs the tokens {', '.join(lacking)}, which the tokenizer does not "
                        "have; set data.template: tokenizer or plain")  # fmt: skip
    return [f"{R1_BOS}{system or ''}{R1_USER}{text}{R1_ASSISTANT}<think>\n" for text in texts]


@TEMPLATES.register("plain")
def _plain_template(tokenizer: Any, texts: Sequence[str], system: str | None) -> list[str]:
    """No chat markup: BOS (when the tokenizer has one), the system prompt and a newline (when set), the text."""
    head = (tokenizer.bos_token if tokenizer.bos_token_id is not None else "") + (f"{system}\n" if system else "")
    return [head + text for text in texts]


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added: one batch call where the tokenizer is a fast one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # transformers clears a backend's own padding and truncation on each call; a batch call here would apply them.
    if backend is not None and backend.padding is None and backend.truncation is None:
        return [encoding.ids for encoding in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def render_prompts(tokenizer: Any, texts: Sequence[str], config: DataConfig | None = None) -> list[list[int]]:
    """``render_prompt`` of each text, encoded in one batch."""
    return encode_texts(tokenizer, render_texts(tokenizer, texts, config))
