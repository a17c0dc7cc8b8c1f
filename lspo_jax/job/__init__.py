"""A training run end to end: its config (``config``, read from YAML by ``config_io``), the loop (``run``) and what
it is built from (``build``: the policy, mesh, verifier, engines, data, and the optional methods wired in), the stop
a signal asks for (``signals``), validation (``evaluation``), the metrics log, progress line, plots, checkpoint
export, the run's lock and the console commands (``cli``; ``lspo-eval``'s body in
``eval_command``, how a command ends in ``errors``). Imports every layer below it."""

from lspo_jax import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"Run": "run", "train_run": "run", "pass_at_k": "evaluation"})
