"""A training run: load the policy and data, loop over steps with validation, checkpoints and metrics.

``lspo-train`` calls ``train_run``. The output directory holds ``config.yaml``, ``metrics.jsonl``,
``tensorboard/``, ``checkpoints/`` (base params and RL optimizer state only), ``summary.json``, and plots.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from lspo_jax import REMOVED_IN
from lspo_jax.job import evaluation
from lspo_jax.job.build import (
    ENGINES,
    AgreedVerifier,
    check_cache_fits,
    check_positions,
    load_benchmarks,
    load_examples,
    load_policy,
    make_token_advantages,
    make_verifier,
    model_dir,
    prompt_source,
    run_meshes,
    validation_specs,
)
from lspo_jax.job.compiles import CompileCount
from lspo_jax.job.metrics_log import MetricsLog, NullLog, rewrite, wandb_options
from lspo_jax.job.progress import Progress, arm_name
from lspo_jax.job.resume import restore, resumed_records
from lspo_jax.job.run_dir import check_resumable, model_shapes, new_run_refused, record_config, run_records
from lspo_jax.job.run_lock import take_run_lock
from lspo_jax.job.signals import StartupStopped, StopFlag
from lspo_jax.job.summary import run_summary, seconds_so_far
from lspo_jax.options import RolloutError
from lspo_jax.rl import staleness, warmup
from lspo_jax.rl.checkpoint import Checkpointer, TrainState
from lspo_jax.rl.learner import Learner
from lspo_jax.rl.phases import Phases, StepAbandoned
from lspo_jax.rl.step_record import GAP_KEY, step_rates
from lspo_jax.tasks import data, example_store
from lspo_jax.tasks.data_report import DataError, DataReport
from lspo_jax.train_config import ConfigError, TrainConfig


class RunStopped(RuntimeError):
    """The run stopped early (non-finite updates in a row); a checkpoint was written first."""


class SamplerGapError(RolloutError):
    """The sampler's log-probs of its own tokens were further from the trainer's than ``rollout.max_logprob_gap`` for
    ``rollout.max_logprob_gap_steps`` steps in a row: it samples another policy than the one trained. A checkpoint
    was written first (the updates took the trainer's own log-probs as old_logp: the state is sound, the rows were
    off-policy)."""


class Run:
    """The state and resources of one training run.

    ``verifier`` replaces the math-verify pool: any object with ``score(responses, golds) -> array`` and
    ``close()``; the run owns it from then on and closes it, also when the run fails to start. The optional methods
    come from the config, through ``build``'s plugs (``PROMPT_METHODS``, ``ADVANTAGE_METHODS``). ``callbacks``: each is
    called with every record the run writes (a copy; ``kind`` says which: ``train``, ``eval``, ``warmup``), after it
    is written; one that returns True asks the run to stop, as a SIGTERM would (a checkpoint, then the summary).
    A ``with`` block closes the run at its end.
    """

    def __init__(
        self, run: TrainConfig, out_dir: str, *, resume: bool = False, verifier: Any = None,
        stop: StopFlag | None = None, callbacks: Sequence[Callable[[dict], Any]] = (),
    ):  # fmt: skip
        self.run, self.out_dir, self.stop, self.callbacks = run, out_dir, stop, tuple(callbacks)
        self._stop_in_force: StopFlag | None = stop  # the flag the loop reads, once training has begun
        self.seconds_before = 0.0  # the wall time of the sessions before a resume, from their summary
        self.gap_bound = run.rollout.logprob_gap_bound(run.model.compute_dtype)
        self.gaps_in_row = 0  # steps in a row whose rollout/logprob_gap was above gap_bound
        ENGINES.resolve(run.rollout.engine).check_installed()  # before the directory and its lock are made
        os.makedirs(out_dir, exist_ok=True)
        # Several hosts share out_dir: process 0 writes the files, all of them write checkpoint shards.
        self.writer = jax.process_index() == 0
        self.lock = take_run_lock(out_dir)  # a second run into out_dir stops here, on every process
        try:
            self._start(run, resume=resume, verifier=verifier)
        except BaseException:
            if self.lock is not None:
                self.lock.close()
            raise

    def _start(self, run: TrainConfig, *, resume: bool, verifier: Any) -> None:
        out_dir = self.out_dir
        # Refusals first, before anything is loaded or written: the run's own config.yaml stays as it was.
        # Checked before the model loads: a W&B run asked for without wandb installed fails here.
        self.wandb = wandb_options(run) if self.writer else None
        records = run_records(out_dir)
        if records and not resume:  # before the checkpointer makes its folder: the directory stays as it was
            raise new_run_refused(out_dir, records)
        self.checkpointer = Checkpointer(os.path.join(out_dir, "checkpoints"), keep=run.checkpoint.keep)
        latest = self.checkpointer.latest_step()
        if latest is None and resume:
            self.checkpointer.close()
            raise FileNotFoundError(f"nothing to resume in {out_dir}: it holds no checkpoint")
        try:
            # A moved model whose shapes could not be compared: what the restore says if the checkpoint does not fit.
            self.unchecked_model = check_resumable(run, out_dir, writer=self.writer) if latest is not None else None
            self._startup_point()
            self._load(run, resume=latest is not None, verifier=verifier)
        except BaseException:
            _close_after_failure(self.checkpointer, "checkpointer")
            raise

    def _load(self, run: TrainConfig, *, resume: bool, verifier: Any) -> None:
        """Model, data, judge, verifier, the learner (its state restored when resuming; the engine last), then
        config.yaml and the metrics log. What started is closed if a later part fails."""
        out_dir = self.out_dir
        self.policy, base = load_policy(run, os.path.join(out_dir, "cache"))
        self._startup_point()
        check_positions(run, self.policy.config, validate=bool(validation_specs(run)))
        if run.rollout.max_staleness and jax.process_count() > 1:  # two threads' collectives could interleave
            raise ConfigError(f"rollout.max_staleness: {run.rollout.max_staleness} runs in one process only; this job "
                              f"has {jax.process_count()}")  # fmt: skip
        # A mesh that does not fit the devices is refused before the data loads; smesh: rollout.placement split's
        # sampler devices, None colocated.
        mesh, smesh = run_meshes(run)
        engine = ENGINES.resolve(run.rollout.engine)
        if run.rollout.engine == "jax":  # vLLM pages its cache and batches what does not fit
            check_cache_fits(run, self.policy.config, mesh, validate=bool(validation_specs(run)))
            if run.rollout.placement == "split":  # the step's rollouts decode on the sampler's devices
                check_cache_fits(run, self.policy.config, smesh, validate=False)
        engine.prepare(run, self.policy, out_dir, logs=bool(self.writer))  # before the data: the engine starts last
        self.examples, self.data_report = load_examples(run, self.policy, run.data.train, run.seed)
        self.data_report.check_kept(f"data.train {run.data.train}")  # none kept: the one line that says why
        for line in self.data_report.warnings(scaffold=run.scaffold.enabled) if self.writer else ():
            print(f"lspo-train: data.train {run.data.train}: {line}", file=sys.stderr)  # also in summary.json
        self.data_digest = example_store.source_digest(run.data.train)  # read with the store's key: no second pass
        self.examples = self.examples[: run.data.limit]  # the first `limit` usable prompts (all when null)
        self._startup_point()
        self.held_out, self.held_out_data = self._held_out()
        self.prompts = prompt_source(run, self.examples, self.policy)
        self.history: list[dict[str, Any]] = []  # every record of the run, those before a resume included
        self.warmed: dict[str, Any] | None = None  # the SFT warm-up's record once it is done (``rl.warmup``)
        # A policy judging itself reads the learner's base at each call.
        token_advantages = make_token_advantages(run, self.policy, lambda: self.learner.base_params(), mesh)
        verifier = make_verifier(run) if verifier is None else verifier
        try:
            # Params and optimizer state are committed to the mesh like the arrays a restore returns: jit keys its
            # cache on placement, so a run resumed in the same process (tests, notebooks) reuses its programs.
            self.learner = Learner(
                run, self.policy, base, mesh=mesh, token_advantages=token_advantages,
                engine=engine.starter(run, self.policy, out_dir),
                verifier=verifier if jax.process_count() == 1 else AgreedVerifier(verifier),
                resume=self._restore if resume else None,
            )  # fmt: skip
        except BaseException:
            _close_after_failure(verifier, "verifier")
            raise
        try:
            # Rollouts sampled ahead of the update, and where (``rollout.placement``; its mesh made with the
            # learner's, so a split the devices cannot make is refused before the data loads).
            self.prefetcher = staleness.Prefetcher(self.learner, self.prompts, smesh)
            # The learner built (the engine started, a checkpoint restored), the longest part; the last point before
            # anything is written, so every process agrees here. A stop after it is the loop's (a checkpoint, 75).
            self._startup_point(agree=True)
            # A new run that warms up first writes its config and log once the warm-up is done: one stopped or killed
            # during it leaves no records, so the same command starts it again (it had nothing to resume from).
            self.log, self._records_deferred = NullLog(), not resume and warmup.wanted(run)
            if not self._records_deferred:
                self._begin_records(resume)
        except BaseException:
            _close_after_failure(self.learner, "learner")
            raise

    def _begin_records(self, resume: bool) -> None:
        """The run's config.yaml and metrics log, once the model and the data have loaded: a run that cannot start
        leaves no config."""
        self._records_deferred = False
        if self.writer:
            record_config(self.run, self.out_dir, self.state.step if resume else None)
            self.log = self._open_log()

    def _startup_point(self, agree: bool = False) -> None:
        """End start-up here if a stop was asked for (``StopFlag.startup_point``). A job of several processes stops
        only where they all ``agree`` (a collective every process reaches), so that none waits for another."""
        if self.stop is None:
            return
        if agree and self.stop.agreed():
            raise StartupStopped("interrupted during start-up; nothing was trained")
        self.stop.startup_point(single_process=jax.process_count() == 1)

    @property
    def state(self) -> TrainState:
        return self.learner.state

    @state.setter
    def state(self, state: TrainState) -> None:
        self.learner.state = state

    def _held_out(self) -> tuple[dict[str, list[data.Example]], dict[str, dict]]:
        """Benchmark name -> examples, and name -> load report; the toy task validates on its held-out classes."""
        loaded = load_benchmarks(self.run, self.policy, validation_specs(self.run))
        for name, (examples, report) in loaded.items():
            if not examples:
                raise DataError(f"eval.benchmarks: {name} keeps no problem to validate on ({report['rows']} "
                                f"rows; {DataReport(**report).losses()})")  # fmt: skip
            if self.writer and (line := DataReport(**report).losses()):
                print(f"lspo-train: eval.benchmarks {name}: {len(examples)} problems validated; {line}",
                      file=sys.stderr)  # fmt: skip
        return {name: ex for name, (ex, _) in loaded.items()}, {name: report for name, (_, report) in loaded.items()}

    # ---------------------------------------------------------------------------------- checkpoints
    def save(self) -> None:
        self._check_lock()
        meta = {self.prompts.meta_key: self.source_state(), "seed": self.run.seed, "data": self.data_digest,
                "model": self.model_record}  # fmt: skip
        if self.warmed is not None:  # the base it holds is warmed up
            meta[warmup.RECORD_KIND] = self.warmed
        self.checkpointer.save_state(self.state, meta, adapter=self.learner.adapter_lifetime.checkpointed)

    def source_state(self) -> dict[str, Any]:
        """The prompt source's state a checkpoint keeps (``Prefetcher.source_state``: from before the draw of any
        rollouts sampled ahead, which a checkpoint does not keep)."""
        return self.prefetcher.source_state()

    def _restore(self, fresh: TrainState, adapter: bool) -> TrainState:
        """The state of the newest readable checkpoint, in ``fresh``'s layout (``adapter``: whether it holds the
        adapter; ``resume.restore``), and the run's records up to that step: what followed it is redone."""
        state, meta = restore(self.checkpointer, fresh, adapter, self.run, unchecked_model=self.unchecked_model,
                              data_digest=self.data_digest, writer=self.writer)  # fmt: skip
        self.warmed = meta.get(warmup.RECORD_KIND)
        self.history = resumed_records(self.out_dir, state.step, self.warmed, writer=self.writer)
        self.seconds_before = seconds_so_far(self.out_dir)
        if meta.get(self.prompts.meta_key) is not None:  # a run resumed with the other source starts it afresh
            self.prompts.load_state_dict(meta[self.prompts.meta_key])
        return state

    @functools.cached_property
    def model_record(self) -> dict[str, Any] | None:
        """The run's ``model_shapes``, recorded in each checkpoint (None if its files can no longer be read)."""
        try:
            return model_shapes(model_dir(self.run, os.path.join(self.out_dir, "cache")))
        except (OSError, ValueError):
            return None

    def _open_log(self) -> MetricsLog:
        """The run's metrics log, cut back to the restored step: a resumed run's records read as if it had
        never stopped (steps logged after its checkpoint are not repeated)."""
        path = os.path.join(self.out_dir, "metrics.jsonl")
        if os.path.exists(path):
            rewrite(path, self.history)
        return MetricsLog(self.out_dir, wandb=self.wandb, purge_step=self.state.step + 1 if self.state.step else None)

    def _check_lock(self) -> None:
        """Stop before a write if the run directory is no longer this run's alone (``RunLock.check``, a ``stat``):
        its lock file removed and taken by another run, or the directory itself replaced. Only the writer holds the
        lock, so in a multi-host job process 0 stops alone, a rare case against two writers that both exit 0."""
        if self.lock is not None:
            self.lock.check()

    def _write(self, record: dict[str, Any]) -> None:
        self._check_lock()
        self.history.append(record)
        self.log.write(record)
        for callback in self.callbacks:
            if callback(dict(record)) is True and self._stop_in_force is not None:
                self._stop_in_force.requested = True  # read at the loop's next point, as a signal's would be

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- loop
    def validate(self, stop: StopFlag | None = None) -> dict[str, dict[str, float]] | None:
        """Score every held-out benchmark (pass@k, and the base's log-likelihood of the gold solutions where the
        benchmark has them); one ``eval`` record per benchmark. Returns name -> metrics. With ``stop``, a stop
        asked for ends the validation before its next batch (``evaluation.ValidationStopped``), writing nothing."""
        if not any(self.held_out.values()):
            return None
        self.prefetcher.wait()  # the generator samples for one caller at a time
        self._expect(f"after validation's current batch at step {self.state.step}: its records are not written "
                     "(a resume validates again); then a checkpoint")  # fmt: skip
        if self.writer:
            problems = sum(len(examples) for examples in self.held_out.values())
            print(f"lspo-train: validating at step {self.state.step}: {problems} problems x {self.run.eval.n} "
                  "samples", file=sys.stderr, flush=True)  # fmt: skip
        key = jax.random.fold_in(jax.random.key(self.run.seed + 1), self.state.step)
        results = evaluation.evaluate_benchmarks(
            self.run, self.learner.generator, self.state.params, self.held_out, self.learner.verifier, key,
            logprobs=self._gold_logprobs, stop=None if stop is None else stop.agreed, step=self.state.step,
        )  # fmt: skip
        for name, result in results.items():
            self._write({"kind": "eval", "step": self.state.step, "benchmark": name, **result})
        return results

    def _gold_logprobs(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        """Per-token log-probs of ``rows`` under the base as it stands: adapter off and temperature 1 whatever the
        rollout's, so the gold solutions are scored by the model's own likelihood, not by the sampling
        distribution's (logits / T)."""
        return self.learner.logprobs(rows, lora_scale=0.0, temperature=1.0)

    def _validate_once(self, stop: StopFlag) -> None:
        """Validate at this step unless its records exist (a resumed run validated it before it stopped)."""
        if not any(r["kind"] == "eval" and r["step"] == self.state.step for r in self.history):
            self.validate(stop)

    def train(self) -> dict[str, Any]:
        run, start = self.run, time.perf_counter()
        if self.state.step == run.steps and self.writer:
            print(f"lspo-train: {self.out_dir} is at step {run.steps} of steps={run.steps}: nothing to train "
                  f"(pass steps=N above {run.steps} to go on)", file=sys.stderr)  # fmt: skip
        if self.stop is not None:  # entered by the caller before start-up: a stop asked for then is seen here
            return self._train(self.stop, start)
        # The handlers stay until the end: a signal during the last save or validation is a stop, not a kill.
        with StopFlag("lspo-train") as stop:
            return self._train(stop, start)

    def _expect(self, plan: str) -> None:
        """What a stop asked for from now on does, as the stop's announcement says it (``StopFlag.expect``)."""
        if self._stop_in_force is not None:
            self._stop_in_force.expect(plan)

    def _train(self, stop: StopFlag, start: float) -> dict[str, Any]:
        run, progress = self.run, None
        self._stop_in_force = stop
        try:
            self._warm_up_once(stop)
        except warmup.WarmupStopped as err:
            return self._warm_up_stopped(err, start)
        try:
            if self.state.step < run.steps and self._due(self.state.step):  # before the first step, or one a
                self._validate_once(stop)  # stop or a kill cut short
            # The first step's time is its own; the lines name the arm (``dapo:`` for the baseline).
            progress = Progress(run.steps, self.state.step, enabled=self.writer, name=arm_name(run.scaffold))
            stopped = self._steps(stop, progress)
        except evaluation.ValidationStopped:  # its records are not written, so a resume validates again
            stopped = True
        if progress is not None:
            progress.close()
        self._expect("after the run's last checkpoint")
        if self.checkpointer.latest_step() != self.state.step:
            self.save()
        if not stopped:
            try:
                self._validate_once(stop)
            except evaluation.ValidationStopped:
                stopped = True
        return self._summary(time.perf_counter() - start, stopped)

    def _warm_up_once(self, stop: StopFlag) -> None:
        """The SFT warm-up before the first step (``scaffold.supervise: sft_warmup``), unless it is done; then a
        checkpoint at step 0 holds the warmed base and, in its meta, the warm-up's record, which is written (``kind:
        warmup``, step 0) after it. Nothing of a warm-up cut short is kept: a stop asked for during it ends it before
        its next update (``warmup.WarmupStopped``, with no checkpoint written), and a run killed during it does it
        again from the start; a resumed one finds it done, its record kept. A stop asked for before it leaves it to
        the resumed run (or, for a new run, to the same command again)."""
        if not warmup.wanted(self.run) or self.warmed is not None or self.state.step:
            return
        if stop.agreed():
            raise warmup.WarmupStopped("before the SFT warm-up began")
        if self.writer:
            print(f"lspo-train: SFT warm-up of the base on {self.run.scaffold.warmup_tokens} solution tokens",
                  file=sys.stderr, flush=True)  # fmt: skip
        self._expect("after the SFT warm-up's current update: the warm-up is not saved (the run does it again whole)")
        self.warmed = warmup.sft_warmup(self.learner, self.examples, stop=stop.agreed)
        if self._records_deferred:
            self._begin_records(resume=False)
        self.save()
        self._write({"kind": warmup.RECORD_KIND, "step": 0, **self.warmed})

    def _warm_up_stopped(self, err: warmup.WarmupStopped, start: float) -> dict[str, Any]:
        """A stop during the SFT warm-up: its updates are dropped, nothing is saved. A new run has written nothing
        yet (``_records_deferred``), so it ends as a stop during start-up does (``StartupStopped``: the same command
        starts it again); a resumed one stops with its checkpoint at step 0, from which ``--resume`` warms up again."""
        if self._records_deferred:
            raise StartupStopped(f"stopped during the SFT warm-up ({err}); nothing was trained or saved: the same "
                                 "command starts the run again")  # fmt: skip
        if self.writer:
            print(f"lspo-train: stopped during the SFT warm-up ({err}); the warm-up is not saved: --resume does it "
                  "again from the checkpoint at step 0", file=sys.stderr)  # fmt: skip
        return self._summary(time.perf_counter() - start, True)

    def _due(self, step: int) -> bool:
        """Whether validation is scheduled at ``step`` (before training, every ``eval.every``, at the end)."""
        every = self.run.eval.every
        return step in (0, self.run.steps) or bool(every and step % every == 0)

    def _steps(self, stop: StopFlag, progress: Progress) -> bool:
        """Steps until ``run.steps``, checkpointing and validating on schedule; returns whether a stop ended them."""
        run = self.run
        while self.state.step < run.steps:
            self._expect(f"at step {self.state.step + 1}'s next phase (a step whose update has begun is finished "
                         "first); then a checkpoint")  # fmt: skip
            if stop.agreed():
                return True
            try:
                metrics = self.one_step(stop)
            except StepAbandoned as err:
                step = self.state.step + 1
                progress.write(f"{progress.name}: {err}: step {step} abandoned, its prompts not consumed")
                return True
            progress.step(self.state.step, metrics)
            self._check_gap(metrics)
            if self.state.nonfinite_in_row >= run.max_nonfinite_in_row:
                self.save()
                raise RunStopped(f"{self.state.nonfinite_in_row} non-finite updates in a row at step "
                                 f"{self.state.step}; checkpoint written")  # fmt: skip
            stopping = stop.agreed()  # once per step, so every process takes the same branches below
            if self.state.step % run.checkpoint.every == 0 or stopping:
                self.save()
            if stopping:
                return True  # no scheduled validation: a stopping job has a grace period to keep
            if self._due(self.state.step) and self.state.step < run.steps:  # the last one follows the loop
                self.validate(stop)
        return False

    def _check_gap(self, metrics: dict[str, Any]) -> None:
        """Stop (``SamplerGapError``, after a checkpoint) once the step's ``rollout/logprob_gap`` has been above the
        bound for ``rollout.max_logprob_gap_steps`` steps in a row. Every process reads the same record, so all of
        them take the same branch and save together."""
        gap = metrics.get(GAP_KEY)
        if self.gap_bound is None or gap is None:
            return
        self.gaps_in_row = self.gaps_in_row + 1 if gap > self.gap_bound else 0
        if self.gaps_in_row < self.run.rollout.max_logprob_gap_steps:
            return
        self.save()
        engine, dtype = self.run.rollout.engine, self.run.model.compute_dtype
        raise SamplerGapError(
            f"the {engine} sampler's log-probs of its own tokens are {gap:.3g} nats a token from the trainer's at step "
            f"{self.state.step}, above rollout.max_logprob_gap {self.gap_bound:g} ({engine}, {dtype}) for "
            f"{self.gaps_in_row} steps in a row: it does not sample the policy being trained (weights not synced?); "
            f"checkpoint written at step {self.state.step}"
        )

    def one_step(self, stop: StopFlag | None = None) -> dict[str, Any]:
        """One training step, logged: the prompt source's draw, the step, the source's observation of it. A step
        abandoned by ``stop`` leaves the source as it found it, so a resume from the next checkpoint draws the
        same prompts. With ``rollout.max_staleness: 1`` its draw and rows may come from the step before, and it may
        start the next step's just before its update (``staleness.Prefetcher``)."""
        compiled = CompileCount()  # the step's programs compiled, in its record (compiles, time_compile)
        stopping = self.stop is not None and self.stop.agreed()  # each step on every process: a collective with several
        draw, result, stale = self.prefetcher.step(Phases(stop), stopping=stopping)
        observed = self.prompts.observe(draw, result.observation)
        metrics = {**result.metrics, **stale, **step_rates(result.metrics), **observed, **compiled.since()}
        self._write({"kind": "train", **metrics})
        return metrics

    def _summary(self, seconds: float, stopped: bool) -> dict[str, Any]:
        """The whole run's figures (``summary.run_summary``), written to summary.json."""
        summary = run_summary(self.history, self.state, stopped=stopped, seconds=seconds,
                              seconds_before=self.seconds_before, held_out_data=self.held_out_data,
                              data_report=self.data_report, warmed=self.warmed)  # fmt: skip
        if self.writer:
            self._check_lock()
            with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        return summary

    def close(self) -> None:
        """Close the learner (engine and verifier), the log and the checkpointer: each even if one before fails.
        Rollouts still sampling ahead are cut short at their next decode segment and dropped first."""
        try:
            self.prefetcher.close()
            self.learner.close()
        finally:
            try:
                self.log.close()
            finally:
                try:
                    self.checkpointer.close()
                finally:
                    if self.lock is not None:
                        self.lock.close()


def _close_after_failure(part: Any, what: str) -> None:
    """Close ``part`` while a failure is on its way out: an error of the close is reported, not raised, so the
    failure that stopped the start is the one the caller sees."""
    try:
        part.close()
    except Exception as err:
        print(f"lspo-train: closing the {what} after a failed start also failed: {err}", file=sys.stderr)


def train_run(
    run: TrainConfig, out_dir: str, *, resume: bool = False, on_finish: Callable[[], None] | None = None,
    stop: StopFlag | None = None, callbacks: Sequence[Callable[[dict], Any]] = (),
) -> dict[str, Any]:  # fmt: skip
    """Train, write everything under ``out_dir``, and return the summary. ``on_finish`` is called once training
    has ended (or failed), before the run's resources close: ``lspo-train`` lets a SIGTERM from then on finish.
    ``stop``: a ``StopFlag`` the caller entered before start-up (a stop asked for during it ends start-up at its
    next point with ``StartupStopped``); None: the run sets its own when training begins. ``callbacks``: ``Run``'s."""
    job = Run(run, out_dir, resume=resume, stop=stop, callbacks=callbacks)
    try:
        return job.train()
    finally:
        if on_finish is not None:
            on_finish()
        job.close()


# Names that moved to a module of their own: the old path warns, then goes.
MOVED = {"surpass_distribution": "lspo_jax.job.summary", "SUMMED": "lspo_jax.job.summary"}


def __getattr__(name: str) -> Any:
    if name not in MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is {MOVED[name]}.{name}; the old path goes in {REMOVED_IN}", DeprecationWarning,
                  stacklevel=2)  # fmt: skip
    return getattr(importlib.import_module(MOVED[name]), name)
