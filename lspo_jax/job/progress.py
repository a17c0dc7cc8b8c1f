"""Progress of a training run on the console: a bar on a terminal, a plain line every few steps elsewhere.

A scheduler's log file is not a terminal: a bar there becomes one line of ``\\r``-joined redraws, so it gets
a line every ``every`` steps instead. The first step compiles the programs, so its time is reported apart
and the rate and the time left count from the second step on.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm


def _postfix(metrics: dict[str, Any]) -> str:
    acc, cliffs, rescued = metrics["accuracy_mean"], metrics["cliff_groups"], metrics["surpassed_groups"]
    return f"acc {acc:.2f}, cliffs {cliffs}, rescued {rescued}"


def _compiled(metrics: dict[str, Any]) -> str:
    """What the first step compiled (``compiles.CompileCount``), or that it included compiling if not counted."""
    if "compiles" not in metrics:
        return "compilation included"
    fresh, cached = metrics["compiles"], metrics["compiles_cached"]
    read = f", {cached} read from the compile cache" if cached else ""
    return f"{metrics['time_compile']:.1f} s of it compiling {fresh} program{'' if fresh == 1 else 's'}{read}"


def arm_name(scaffold: Any) -> str:
    """What a run's progress lines call it: ``lspo`` (the adapter scaffold), ``dapo`` (the scaffold off, the
    baseline), else the supervision of the base it trains with (``base``, ``mixed``, ``sft_warmup``)."""
    if not scaffold.enabled:
        return "dapo"
    return "lspo" if scaffold.supervise == "adapter" else scaffold.supervise


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    """Steps ``initial + 1 .. total`` of a run, shown on ``stream`` (default stderr) when ``enabled``.

    ``every`` (default: about 20 lines a run) spaces the plain lines; a terminal gets the bar. ``name`` starts each
    line (``arm_name``: what the run trains, so a DAPO baseline's lines do not read as LSPO's).
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, stream: TextIO | None = None,
                 every: int | None = None, name: str = "lspo"):  # fmt: skip
        self.total, self.initial, self.enabled, self.name = total, initial, enabled, name
        self.stream = stream or sys.stderr
        self.every = every or max(1, (total - initial) // 20)
        self.terminal = enabled and self.stream.isatty()
        self.bar = None
        self.first_done: float | None = None  # when the first step of this process ended: the rate counts from it
        self.started = time.perf_counter()

    def _bar(self, initial: int) -> tqdm:
        return tqdm(total=self.total, initial=initial, desc=self.name, unit="step", dynamic_ncols=True,
                    file=self.stream)  # fmt: skip

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        """Step ``step`` has ended with ``metrics``."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.first_done is None:
            self.first_done = now
            self.write(f"{self.name}: step {step} took {now - self.started:.1f} s, {_compiled(metrics)}; the time left "
                       "counts from the next step")  # fmt: skip
            if self.terminal:
                self.bar = self._bar(step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(_postfix(metrics))
        elif step % self.every == 0 or step == self.total:
            self.write(self._line(step, metrics, now))

    def _line(self, step: int, metrics: dict[str, Any], now: float) -> str:
        line = f"{self.name}: step {step}/{self.total}, {_postfix(metrics)}"
        done = step - self.initial - 1  # steps timed since the first one
        if done > 0:
            per_step = (now - self.first_done) / done
            line += f", {per_step:.2f} s/step, {_duration(per_step * (self.total - step))} left"
        return line

    def write(self, line: str) -> None:
        """A line that does not break the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
