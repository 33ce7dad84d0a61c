"""Where a run starts, decided on rank 0 before any data loads: a fresh run into an empty (or
overwritten) run.out_dir, or a resume from the newest complete checkpoint of the same run."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

from . import checkpoint, config, logs, outdir
from .errors import ConfigError, DataError


@dataclass
class Resume:
    """What a resume continues: the newest complete checkpoint's folder and manifest (None: none
    yet, the run starts from round 1), the round folders skipped and why, and the metrics files'
    lines it keeps (logs.kept_rows)."""

    folder: str | None
    manifest: dict | None
    skipped: list[str]
    kept: dict[str, list[str]]


def refuse_before_data(rc: config.RunConfig, identity: dict) -> Resume | None:
    """Rank 0's refusals before any data loads, reading and changing nothing: the run makes them
    with run.out_dir locked, ``python -m fedddp --check`` (fedddp.__main__.check) before any rank
    starts, so it exits with the status the run would. No TensorBoard for run.tensorboard; a fresh
    run into a folder holding results without run.overwrite; a resume whose round folders are all
    incomplete though some save finished (damaged, not interrupted), whose newest complete
    checkpoint is of another run or past run.rounds, or whose metrics files have a damaged line.
    ``identity``: the run's (checkpoint.identity), which a checkpoint it resumes must hold. A
    resume's choice (for ``start``); None for a fresh run."""
    if rc.tensorboard:
        logs.require_tensorboard()
    if not rc.resume:
        outdir.refuse_fresh_run(rc.out_dir, rc.overwrite)
        return None
    ckpt_root = os.path.join(rc.out_dir, "checkpoints")
    folder, manifest, skipped = checkpoint.newest_complete(ckpt_root)
    if folder is None:
        if skipped and any(os.path.exists(os.path.join(f, checkpoint.MANIFEST))
                           for _, f in checkpoint.round_folders(ckpt_root)):
            raise DataError(f"checkpoints: {len(skipped)} round folder(s) in {ckpt_root} but none is "
                            f"complete ({'; '.join(skipped)}); nothing to resume: start over with "
                            "run.resume=false run.overwrite=true")
        return Resume(None, None, skipped, {})
    changes = checkpoint.identity_changes(manifest["identity"], identity)
    if changes:
        raise ConfigError(f"run.resume: the checkpoint {folder} is of another run: {'; '.join(changes)}; "
                          "resume with its values, or start a new run in another run.out_dir")
    if manifest["round"] > rc.rounds:
        raise ConfigError(f"run.rounds: {rc.rounds} is below the round of the checkpoint {folder} "
                          f"({manifest['round']}); set run.rounds >= {manifest['round']} to continue it")
    # a damaged row is one line (exit 3) here, before any data loads
    return Resume(folder, manifest, skipped, logs.kept_rows(rc.out_dir, manifest["round"]))


def start(rc: config.RunConfig, resume: Resume | None) -> int:
    """Where the run starts, after ``refuse_before_data``: a fresh run clears the folder's earlier
    results (run.overwrite); a resume cuts the metrics files back to its checkpoint's round.
    Returns that round (0: the run starts from round 1). ``rc``: the RunConfig."""
    if resume is None:
        outdir.refuse_or_clear(rc.out_dir, rc.overwrite)
        return 0
    ckpt_root = os.path.join(rc.out_dir, "checkpoints")
    if resume.folder is None:
        if resume.skipped:
            # No save ever finished (a full disk or a kill during the first checkpoint): there is
            # nothing to continue and nothing to lose, so the rerun that the exit-5 line advises
            # and a torchrun restart start from round 1 instead of refusing.
            for _, f in checkpoint.round_folders(ckpt_root):
                shutil.rmtree(f)
            print(f"fedddp: no checkpoint in {ckpt_root} was ever completed ({'; '.join(resume.skipped)}); "
                  "removed its round folder(s), starting from round 1", file=sys.stderr, flush=True)
        else:
            print(f"fedddp: run.resume=true but {ckpt_root} holds no checkpoint; starting from round 1",
                  file=sys.stderr, flush=True)
        return 0
    with outdir.disk_full_is_one_line("metrics.jsonl, metrics.csv and clients.jsonl", rc.out_dir,
                                      resume.folder):
        logs.cut_back(resume.kept)
    why = f"; skipped {'; '.join(resume.skipped)}" if resume.skipped else ""
    print(f"fedddp: resuming from round {resume.manifest['round']} ({resume.folder}){why}", file=sys.stderr,
          flush=True)
    return resume.manifest["round"]
