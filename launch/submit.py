#!/usr/bin/env python
"""Submit one fedddp run to Slurm through submitit: the command of fedddp/slurm.py (its
docstring, or --help, says more), kept here for the commands written with this path.

  python launch/submit.py CONFIG.toml [section.key=value ...] [launcher flags]
  python -m fedddp.slurm  CONFIG.toml [section.key=value ...] [launcher flags]   the same

Exit status: 0 submitted (with --wait: done); fedddp's status for a config (2) or data (3)
mistake found before queueing, or, with --wait, the failed run's.
"""

import sys

from fedddp.slurm import main

if __name__ == "__main__":
    sys.exit(main(prog="launch/submit.py"))
