"""Draw a run's curves (``metrics.jsonl``) to PNG files in the run directory.

.venv/bin/python -m tools.plot_metrics runs/demo [runs/other ...]
"""

import argparse

from lspo_jax.job.plots import plot_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", help="training output directories (--out of lspo-train)")
    for run_dir in p.parse_args().run_dirs:
        for path in plot_run(run_dir):
            print(path)


if __name__ == "__main__":
    main()
