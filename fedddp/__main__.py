"""Run one federated experiment.

  python -m fedddp configs/quickstart.toml [section.key=value ...]            one process
  torchrun --standalone --nproc_per_node=4 -m fedddp configs/quickstart.toml  four ranks
  python -m fedddp --check configs/quickstart.toml [section.key=value ...]    check, run nothing
  python -m fedddp --verbose configs/quickstart.toml                          the start line's long form
  python -m fedddp --help                      every config key, algorithm and built-in rule parameter
  python -m fedddp --help NAME                 an algorithm's or rule's parameters (a plugin: module:attr)
  python -m fedddp --version

--check reads the config and builds every client's data and the model in this one process
(what all ranks together would load), runs one forward pass to compare the model's output with
the task (classes or regression; with run.parallel_clients > 1 it tries one side-by-side step
too), makes every other refusal the run makes before round 1 (run.out_dir, a resume's checkpoint,
a batch of one sample for BatchNorm) without writing anything, then says OK or exits with the
status the run would: the launchers run it before they start any rank.

Exit status: 0 done; 2 bad configuration; 3 data missing, unreadable or not finite; 4 the model
diverged; 5 disk full; 6 a rank stopped answering for run.collective_timeout_s; 7 your own code
(a data or model callable, a plugin rule) raised: FEDDDP_TRACEBACK=1 prints its traceback
(docs/running.md). A user's mistake is one line on stderr, never a traceback.
"""

from __future__ import annotations

import os
import sys
import traceback

# Transparent huge pages for torch's CPU allocations: the server rules write fresh [P] outputs
# every round, and on ResNet-18 the page faults of a 45 MB output cost more than the arithmetic
# (bench/aggregate.py: 20-40% faster at K = 4). Read by torch when it starts, so set before any
# import of torch; an explicit setting in the environment wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# Only modules that need no torch are imported here: --help, --version, the usage and a mistake
# in the config file answer before torch is loaded (seconds on a busy machine). The run's own
# modules are imported where they are first needed.
from . import config, console, env, usage
from .errors import DataError, PluginError, StalledError, UserError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a few lines: what to type (--help has them all)
        print(usage.short(__doc__), file=sys.stderr)
        return 2
    if argv[0] == "--version":
        print(usage.version())
        return 0
    if argv[0] in ("-h", "--help"):
        try:
            if len(argv) == 1:
                print(usage.keys(__doc__) + "\n", flush=True)
                print(usage.rules())
            else:
                print(usage.rule(argv[1]))
        except UserError as exc:
            print(f"fedddp: error: {exc}", file=sys.stderr)
            return exc.exit_code
        return 0
    if argv[0] == "--verbose":  # the start line's long form, on every rank (torchrun passes argv to each)
        os.environ[env.VERBOSE_VAR] = "1"
        argv = argv[1:]
        if not argv:
            print(usage.short(__doc__), file=sys.stderr)
            return 2
    if "--check" in argv[1:]:  # read as an override, it would be refused without saying why
        print("fedddp: error: --check goes first, before the config file and the overrides: "
              "python -m fedddp --check CONFIG.toml [section.key=value ...]", file=sys.stderr)
        return 2
    check = argv[0] == "--check"
    if check:
        argv = argv[1:]
        if not argv:
            print("fedddp: error: --check needs a config file or overrides", file=sys.stderr)
            return 2
    path, overrides = (None, argv) if "=" in argv[0] else (argv[0], argv[1:])
    rank, world_size = 0, 1
    try:
        if check:
            return _check(path, overrides)
        proc = env.resolve()
        rank, world_size = proc.rank, proc.world_size
        config.check_alone(path, overrides)
        from . import api

        api.execute(proc, path, overrides)
    except UserError as exc:
        # Every rank sees the same configuration error: say it once. A data error may be one
        # rank's own (its clients' files), so each rank that has one says it; so does a rank
        # whose peers did not all arrive (exit 6, StalledError) and one whose plugin code raised
        # (exit 7: a local rule's hook fails on the rank that trains the client).
        if rank == 0 or isinstance(exc, (DataError, StalledError, PluginError)):
            if isinstance(exc, PluginError) and os.environ.get("FEDDDP_TRACEBACK") == "1":
                console.end_line()
                traceback.print_exception(exc.__cause__, file=sys.stderr)  # the user's, before our line
            line = f"fedddp: error: {exc}"
            console.say(line)
            # The rank whose own data failed says what; rank 0's relay of it comes after.
            relayed = "another rank" in str(exc)
            env.write_status(exc.exit_code, line, rank + (world_size if relayed else 0))
        return exc.exit_code
    except KeyboardInterrupt:
        if rank == 0:
            console.say(interrupted_line(path, overrides))
        return 130
    return 0


def interrupted_line(path: str | None, overrides: list[str]) -> str:
    """Ctrl-C's line: how the same command continues the run (its folder read from the config)."""
    try:
        out_dir = config.parse(path, overrides)[0].run.out_dir
    except UserError:
        out_dir = None
    from .checkpoint import how_to_continue  # torch is loaded by then, unless the config was being read

    words = how_to_continue(out_dir)
    return f"fedddp: interrupted {words}" if words.startswith("before") else f"fedddp: interrupted; {words}"


def check(path: str | None, overrides: list[str], data: bool = True) -> config.Config:
    """The config, then (with ``data``) every client's data, in this process: a mistake raises
    the UserError the run would have raised (fedddp.api.check). The launchers call this before
    any rank starts. What the file shows by itself is said before torch is imported."""
    config.check_alone(path, overrides)
    from . import api

    return api.check(path, overrides, data)


def _check(path: str | None, overrides: list[str]) -> int:
    cfg = check(path, overrides)
    print(f"fedddp: {path or 'config'}: configuration and data OK ({cfg.data.name}, "
          f"{cfg.data.num_clients} clients)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
