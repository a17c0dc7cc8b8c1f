"""What the policy is trained and judged on: prompts, gold answers and worked solutions (``data``: read from a
source by ``sources``, rendered by ``templates``, counted in ``data_report``; cached by ``example_store``), the math
verifier and its worker pool (``rewards``, ``verify_pool``), the demo's generated column sums (``toy``), and the text
helpers that grading, the judge and one-line errors share (``text``). Imports only the package's root."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__, {"math_reward": "rewards", "overlong_penalty": "rewards", "VerifierPool": "verify_pool"}
)
