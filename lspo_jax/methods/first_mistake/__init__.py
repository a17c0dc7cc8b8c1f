"""First-mistake token advantages: a teacher judge names where each failed rollout first went wrong, and the
tokens before that point stop being penalised (``advantages``). ``sentences`` splits a rollout into numbered
sentences mapped to its tokens; ``teacher`` holds the judge's prompts, its replies' reading and the models that
write them; ``strategy`` is the method as the step's token-advantages strategy and its builder; ``config`` its
section of the run's config, ``first_mistake``."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "first_mistake_advantages": "advantages", "Judge": "teacher", "JudgedAdvantages": "strategy",
        "make_token_advantages": "strategy", "FirstMistakeConfig": "config",
    },
)  # fmt: skip
