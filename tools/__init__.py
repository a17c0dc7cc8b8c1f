"""The experiment tools: run each from the repository root as ``python -m tools.NAME`` (``--help`` says what it does).

Not part of the installed package: they use ``lspo_jax`` as a user would, and the tests import them as modules.
"""

from pathlib import Path

# The larger data files (GSM8K, AIME 1983-2023) that the tools read and the package never ships: the folder beside the
# repository where its developers keep them (``--data-dir`` names another).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
