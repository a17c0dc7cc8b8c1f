"""The split placement (``rollout.placement: split``) on 4 CPU devices, run by ``test_staleness.py`` in a fresh
process: the pytest process has started JAX with one device. Three runs of the training-loop tests' shapes, 2
devices learning and 2 sampling, one update stale; prints one JSON object of what they did for the test to assert on:

- ``placed``: the devices of the learner's params, of every push's copy of the base, and of each generator call
  that sampled a step's rollouts; ``again``: whether step 2's rows (tokens, mask, sampler log-probs) equal the ones
  the sampler's mesh draws from a host copy of the base pushed before step 1's update, with the key an on-policy
  run gives them.
- ``whole``: 4 steps (checkpoints at 2 and 4); ``resumed``: the same run stopped at its step-2 checkpoint and resumed;
  ``stopped``: SIGTERM during step 1, then resumed. Each with its train records (timings dropped) and the prompt
  rows each step's rollouts were drawn for.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 4)  # before any use of JAX: two devices to learn, two to sample

import numpy as np  # noqa: E402
from run_fixtures import (  # noqa: E402
    EASY_ROWS,
    addition_rows,
    config_maker,
    copy_tree,
    rule_of,
    run_steps,
    train_records,
    wrap,
    write_jsonl,
)

from lspo_jax.job import toy_model  # noqa: E402
from lspo_jax.rl import staleness  # noqa: E402

SPLIT = {"rollout__max_staleness": 1, "loss__tis_cap": 2.0, "rollout__placement": "split", "steps": 4}
TIMINGS = ("rollout/overlap_s", "rollout/overlap_share", "rollout/prefetch_s", "rollout/push_s")


def ids(tree) -> list[int]:
    return sorted({d.id for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set})


def logged_run(make, out, rule, *, resume=False, stop_after=None, **overrides):
    """Train ``make(**SPLIT, **overrides)`` into ``out``; returns the closed run, what it placed where and the prompt
    rows of every step's rollouts. ``stop_after``: SIGTERM this process once that many steps are done."""
    log = {"pushed": [], "sampled": [], "draws": [], "bases": [], "taken": []}

    def prepare(job):
        log["learner"] = ids(job.learner.state.params)
        sampling = job.prefetcher.sampling
        real_push = sampling.push

        def push(learner):
            log["bases"].append(copy_tree(learner.base_params()))  # on the host: the base the rows came from
            copy, seconds = real_push(learner)
            log["pushed"].append(ids(copy))
            return copy, seconds

        sampling.push = push
        sampler_mesh = [d.id for d in sampling.generator.mesh.devices.flat]
        wrap(sampling.generator, "generate", before=lambda params, *a, **k: log["sampled"].append(
            {"params": ids(params), "mesh": sorted(sampler_mesh)}))  # fmt: skip

        def init(self, learner, draw, snapshot, sampling):
            log["draws"].append([ex.prompt_ids for ex in draw.examples])
            real_init(self, learner, draw, snapshot, sampling)

        def rows(self):
            log["taken"].append(real_rows(self))
            return log["taken"][-1]

        staleness.Prefetch.__init__, staleness.Prefetch.rows = init, rows
        if stop_after is not None:
            wrap(job, "one_step", after=lambda _: job.state.step == stop_after and os.kill(os.getpid(), signal.SIGTERM))
        log["job"] = job

    try:
        job = run_steps(make(**{**SPLIT, **overrides}), out, rule, resume=resume, prepare=prepare)
    finally:
        staleness.Prefetch.__init__, staleness.Prefetch.rows = real_init, real_rows
    return job, log


real_init, real_rows = staleness.Prefetch.__init__, staleness.Prefetch.rows


def values(out: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in train_records(out)]


def main() -> None:
    root = tempfile.mkdtemp()
    rows = addition_rows()
    make = config_maker(toy_model.ensure_model(os.path.join(root, "toy"), steps=0),
                        write_jsonl(os.path.join(root, "train.jsonl"), rows))  # fmt: skip
    rule = rule_of({rows[i]["answer"] for i in EASY_ROWS})
    result = {"devices": [d.id for d in jax.devices()]}

    whole, log = logged_run(make, os.path.join(root, "whole"), rule)
    result["placed"] = {k: log[k] for k in ("learner", "pushed", "sampled")}
    # Step 2's rows (taken from the prefetch started during step 1) sampled again from the base before step 1's
    # update, on the sampler's mesh, with step 2's on-policy key.
    key = jax.random.split(jax.random.fold_in(jax.random.key(whole.run.seed), 1))[0]
    sampling = staleness.Sampling(whole.learner, whole.prefetcher.sampling.generator.mesh)
    base = jax.device_put(log["bases"][1], sampling.layout)
    again = whole.learner.sample_from(base, sampling.generator, log["draws"][1], key, lora_scale=0.0)
    result["whole"] = {"records": values(os.path.join(root, "whole")), "draws": log["draws"]}
    taken = log["taken"][1]  # step 2's rows: the second prefetch's
    result["again"] = {
        name: bool(np.array_equal(taken[name], again[name])) for name in ("tokens", "mask", "sampler_logp")
    }

    part = os.path.join(root, "resumed")
    logged_run(make, part, rule, steps=2)
    logged_run(make, part, rule, resume=True)
    result["resumed"] = {"records": values(part)}

    stopped = os.path.join(root, "stopped")
    first, _ = logged_run(make, stopped, rule, stop_after=1)
    result["stopped_summary"] = {k: first.summary[k] for k in ("steps", "stopped_early")}
    _, log = logged_run(make, stopped, rule, resume=True)
    result["stopped"] = {"records": values(stopped), "draws": log["draws"]}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
