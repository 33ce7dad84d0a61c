"""Several runs, one after another, in each rank of one torchrun (tests/fedrun.py run_fedddp_each).

  torchrun ... tests/torchrun_runs.py RUNS.json

RUNS.json holds a list of argument lists, each what ``python -m fedddp`` would get. Every rank
calls ``fedddp.__main__.main`` (what ``python -m fedddp`` runs) on each in turn, in a process
group of its own each time, and stops at the first non-zero status. Rank 0 appends each status
to RUNS.json.status as it ends. One torchrun, one Python and one torch import per rank serve
several runs: the launch, not the run, is what several separate torchruns would repeat.
"""

import json
import os
import sys

from fedddp.__main__ import main  # first: it sets what torch reads when it is imported
from fedddp.api import _TorchGlobals


def run_all(path: str) -> int:
    with open(path) as fh:
        runs = json.load(fh)
    for argv in runs:
        saved = _TorchGlobals()
        try:
            status = main(argv)
        finally:
            saved.restore()
        if os.environ.get("RANK", "0") == "0":
            with open(path + ".status", "a") as fh:
                fh.write(f"{status}\n")
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1]))
