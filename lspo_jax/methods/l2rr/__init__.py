"""Learning-to-reweight rollout (L2RR): a prompt sampler that learns which prompts to draw, and how many rollouts
each gets, from a held-out target set's gradient. ``draws`` is its numpy side (weights, budgets, the sampler),
``target`` its JAX side (the directional derivatives ``<g_tgt, g_i>`` on the mesh), ``prompts`` the method as
the run's prompt source with the target's scores as a hook around the update, and its builder; ``config`` its section
of the run's config, ``l2rr``, and its sizing."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ("waste_penalty", "target_signal", "allocation_budget", "split_budget", "PromptSampler", "L2RRSampler"),
            "draws",
        ),
        **dict.fromkeys(
            (
                "directional_derivatives", "PolicyLosses", "target_row_weights", "target_gradient",
                "sharded_target_gradient", "sharded_directional_derivatives", "TargetSide", "TargetScorer",
                "FORWARD_MODE_ATTENTION", "load_target",
            ),
            "target",
        ),
        **dict.fromkeys(("L2RRConfig", "score_micro_batches", "target_micro_batches"), "config"),
        **dict.fromkeys(("L2RRPrompts", "TargetScores", "DrawRecord", "make_prompt_source"), "prompts"),
    },
)  # fmt: skip
