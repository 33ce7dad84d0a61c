"""Run one federated experiment.

  python -m fedddp configs/quickstart.toml [section.key=value ...]            one process
  torchrun --standalone --nproc_per_node=4 -m fedddp configs/quickstart.toml  four ranks
  python -m fedddp --help                                                     every config key

Exit status: 0 done; 2 bad configuration; 3 data missing or unreadable. A user's mistake is
one line on stderr, never a traceback.
"""

from __future__ import annotations

import sys

from . import config, env
from .errors import DataError, UserError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nConfig keys (TOML tables; override as section.key=value):\n"
              + config.describe())
        return 0 if argv else 2
    path, overrides = (None, argv) if "=" in argv[0] else (argv[0], argv[1:])
    comm, rank = None, 0
    try:
        proc = env.resolve()
        rank = proc.rank
        cfg = config.load(path, overrides)
        from .comm import Comm
        from .round import run
        comm = Comm(proc, cfg.run.device)
        run(cfg, comm)
    except UserError as exc:
        # Every rank sees the same configuration error: say it once. A data error may be one
        # rank's own (its clients' files), so each rank that has one says it.
        if rank == 0 or isinstance(exc, DataError):
            print(f"fedddp: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fedddp: interrupted", file=sys.stderr)
        return 130
    finally:
        if comm is not None:
            comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
