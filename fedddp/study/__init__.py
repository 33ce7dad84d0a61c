"""Study tools over finished runs, apart from the runtime: sweeps of runs (``sweep``), summaries
over seeds (``summary``), the reduced paper tables written up (``results``) and plots (``plot``).
Each is a command: ``python -m fedddp.study.sweep``, ``... .summary``, ``... .results``,
``... .plot``."""
