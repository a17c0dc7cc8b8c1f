"""The experiment tools: run each from the repository root as ``python -m tools.NAME`` (``--help`` says what it does).

Not part of the installed package: they use ``lspo_jax`` as a user would, and the tests import them as modules.
"""
