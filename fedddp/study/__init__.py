"""Study tools over finished runs, apart from the runtime: sweeps of runs (``sweep``), summaries
over seeds (``summary``), the reduced paper tables written up (``results``) and plots (``plot``).
Each is a command: ``python -m fedddp.study.sweep``, ``... .summary``, ``... .results``,
``... .plot``."""


def moved(old: str, new: str, name: str) -> None:
    """The body of a module's old name, kept for one release after the study tools moved here:
    ``python -m OLD ARGS`` says the new name once and runs ``python -m NEW ARGS`` (its output and
    exit status); ``import OLD`` gives the module NEW. ``name`` is the old module's ``__name__``."""
    import importlib
    import runpy
    import sys
    import warnings

    if name == "__main__":
        print(f"fedddp: `python -m {old}` is now `python -m {new}`; the old name goes in the next "
              "release", file=sys.stderr)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
    else:
        warnings.warn(f"{old} is now {new}; the old name goes in the next release", DeprecationWarning,
                      stacklevel=3)
        sys.modules[old] = importlib.import_module(new)
