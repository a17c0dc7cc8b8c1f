"""Learning-to-reweight rollout (L2RR): a prompt sampler that learns which prompts to draw, and how many rollouts
each gets, from a held-out target set's gradient. ``draws`` is its numpy side (weights, budgets, the sampler),
``target`` its JAX side (the directional derivatives ``<g_tgt, g_i>`` on the mesh), ``prompts`` the method as
the run's prompt source with the target's scores as a hook around the update, and its builder."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ("waste_penalty", "target_signal", "allocation_budget", "split_budget", "PromptSampler", "L2RRSampler"),
            "draws",
        ),
        # The draw rounds L2RR shares with dynamic sampling; and, for the old path ``lspo_jax.reweight`` (which
        # held both samplers as prompt sources), dynamic sampling's names too.
        **dict.fromkeys(
            ("DrawResult", "RoundFn", "collect_batch", "DynamicSamplingPrompts", "sample_round", "assemble_batch",
             "in_slots"),
            "lspo_jax.rl.rounds",
        ),
        **dict.fromkeys(
            (
                "directional_derivatives", "PolicyLosses", "target_row_weights", "target_gradient",
                "sharded_target_gradient", "sharded_directional_derivatives", "TargetSide", "TargetScorer",
                "FORWARD_MODE_ATTENTION", "load_target",
            ),
            "target",
        ),
        **dict.fromkeys(("L2RRPrompts", "TargetScores", "DrawRecord", "make_prompt_source"), "prompts"),
    },
)  # fmt: skip
