"""Compiled programs: JAX's persistent compilation cache for a run, and the programs each step compiled.

A run compiles each jitted program once per shape it meets (a new bucket of rows or lengths is a new program); on
the accelerator the first step's minutes are mostly that. ``use_cache`` keeps every compiled program on disk, so
a second run of the same shapes, or a resume, reads them back instead. ``CompileCount`` counts, from JAX's own
monitoring events, the programs compiled between two points of a run and the seconds spent tracing, lowering
and compiling them: a step's record says how much of its time was compiling and whether a new shape appeared.

The cache takes effect when set before the process's first compile (JAX decides once per process whether it
uses it), so the entry points (``lspo-train``, ``lspo-eval``, the tools) set it first thing; library functions
never do.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import threading
import warnings

import jax

from lspo_jax.config import cache_root

ENV = "LSPO_JAX_COMPILATION_CACHE"  # the default's location; empty turns the default off

# JAX's monitoring events (jax._src.dispatch and jax._src.compiler). A backend compile is recorded both when XLA
# compiles and when the persistent cache hands the program back; the hits are recorded apart.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"

# A step record's keys of ``CompileCount.since``: like its times, they depend on the process's history (what it had
# compiled before, what the disk cache holds), not on the run: a resumed run's first step compiles again.
KEYS = ("compiles", "compiles_cached", "time_compile")


def cache_dir(setting: str | None) -> str | None:
    """The directory of the ``compile_cache`` setting: ``default`` is ``$LSPO_JAX_COMPILATION_CACHE`` when set
    (empty: none), else ``cache_root()/xla``; ``None`` (YAML null) keeps none; anything else is the directory."""
    if setting is None:
        return None
    if setting == "default":
        return os.environ.get(ENV, str(cache_root() / "xla")) or None
    return os.path.expanduser(setting)


def use_cache(setting: str | None) -> str | None:
    """Keep compiled programs in the directory of ``setting`` (see ``cache_dir``), every program however fast it
    compiled (the many small ones of a step add up, and a second run should compile none); returns the directory.
    A directory the user gave JAX itself (``JAX_COMPILATION_CACHE_DIR``) is left alone under ``default``."""
    path = cache_dir(setting)
    if setting == "default" and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    jax.config.update("jax_enable_compilation_cache", path is not None)
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        _one_line_for_cache_errors()
    return path


CACHE_ERROR = re.compile(r"Error (reading|writing) persistent compilation cache entry for '[^']*': (.*)", re.S)


@functools.cache
def _one_line_for_cache_errors() -> None:
    """JAX warns once per program when its cache cannot be read or written (a directory deleted mid-run: 56
    warnings, 112 lines, in a short run). The first says what and that programs still compile; the rest are the
    same news. Other warnings pass as before. Installed once per process."""
    previous, told = warnings.showwarning, []

    def show(message, category, filename, lineno, file=None, line=None):
        found = CACHE_ERROR.match(str(message))
        if found is None:
            return previous(message, category, filename, lineno, file, line)
        if not told:
            told.append(True)
            cause = found[2].strip().splitlines()[0][:200]
            done = {"reading": "read", "writing": "written"}[found[1]]
            print(f"lspo_jax: the compile cache {jax.config.jax_compilation_cache_dir} cannot be {done} ({cause}); "
                  "programs compile as usual (this is said once)", file=sys.stderr)  # fmt: skip

    warnings.showwarning = show


class _Totals:
    """Process-wide sums of the compile events since the listeners were installed."""

    def __init__(self):
        self.lock = threading.Lock()  # programs may compile on other threads (the verifier's, a sampler's)
        self.programs = self.cache_hits = 0
        self.seconds = 0.0

    def on_duration(self, event: str, seconds: float, **_) -> None:
        if event in (BACKEND_COMPILE, TRACE, LOWER):
            with self.lock:
                self.programs += event == BACKEND_COMPILE
                self.seconds += seconds

    def on_event(self, event: str, **_) -> None:
        if event == CACHE_HIT:
            with self.lock:
                self.cache_hits += 1

    def snapshot(self) -> tuple[int, int, float]:
        with self.lock:
            return self.programs, self.cache_hits, self.seconds


@functools.cache
def _totals() -> _Totals:
    totals = _Totals()
    jax.monitoring.register_event_duration_secs_listener(totals.on_duration)
    jax.monitoring.register_event_listener(totals.on_event)
    return totals


class CompileCount:
    """The programs compiled since this object was made: ``since()`` gives ``compiles`` (compiled by XLA),
    ``compiles_cached`` (read back from the persistent cache instead) and ``time_compile`` (seconds tracing,
    lowering and compiling, reads included). A call that hit JAX's in-memory cache compiled nothing and counts 0."""

    def __init__(self):
        self.totals = _totals()
        self.start = self.totals.snapshot()

    def since(self) -> dict[str, int | float]:
        programs, hits, seconds = (now - then for now, then in zip(self.totals.snapshot(), self.start, strict=True))
        return {"compiles": programs - hits, "compiles_cached": hits, "time_compile": seconds}
