"""What a sampling call takes and gives back, whichever engine runs it (the JAX sampler or vLLM): how to sample
(``Decoding``), the padded rows of a call (``SampleBatch``) and one record per row (``Completion``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

PAD_ID = 0  # what a finished row emits; its log-prob is 0 and it is cut from every returned record


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled continuation: ``tokens`` and ``logprobs`` [length] (EOS included when produced)."""

    prompt_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str  # "eos" or "length"


@dataclasses.dataclass(frozen=True)
class SampleBatch:
    """Padded results of one call, rows in prompt order (n consecutive rows per prompt).

    ``tokens``/``logprobs`` are [C, max_new_tokens]; past a row's ``lengths`` they hold ``PAD_ID`` and 0.
    ``steps`` is how many decode steps ran: the longest row's length when every row ended early.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    eos: np.ndarray
    n: int
    steps: int

    def completions(self) -> list[Completion]:
        return [
            Completion(
                prompt_index=row // self.n,
                tokens=self.tokens[row, :length].copy(),
                logprobs=self.logprobs[row, :length].copy(),
                finish_reason="eos" if self.eos[row] else "length",
            )
            for row, length in enumerate(self.lengths.tolist())
        ]


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How to sample, as one value: what every engine's call takes besides the params, prompts, key, the number
    of samples per prompt and the adapter's scale (``generate_arrays(..., **decoding.kwargs())``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def kwargs(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
