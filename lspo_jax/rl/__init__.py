"""The RL step: losses and advantages (``losses``), log-prob passes (``logprobs``), optimizers (``optim``), the
scaffold's cliffs and splice (``scaffold``), spliced-row corrections (``corrections``), row packing
(``packing``), the sharded programs (``distributed``), the learner and its train state (``learner``,
``checkpoint``), the prompt sources' interface (``prompts``), the step itself (``train``), its timed phases and
stop points (``phases``), what the cliffs' worked solutions train (``supervise``), the step's record
(``step_record``) and the next step's rollouts sampled during its update (``staleness``). Imports the root,
``models``, ``tasks`` and ``rollout``; never a method by name."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "group_advantages": "losses", "policy_loss": "losses", "sft_loss": "losses", "find_cliffs": "scaffold",
        "AdapterNotOnError": "scaffold", "Learner": "learner", "train_step": "train",
    },
)  # fmt: skip
