"""Rank 0's book of a run: config.toml, the start line, each round's rows of metrics.jsonl,
metrics.csv and clients.jsonl (logs.py) with its phase timings, the progress line and the closing
line."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from . import callbacks, checkpoint, client_eval, config, console, env, logs, outdir, strategies
from .algorithms import describe as describe_algorithm
from .plan import RoundPlan, describe as describe_schedule


class Progress:
    """One line on rank 0: round, test metric (accuracy or MAE), train loss, (DP-FedAvg) the last
    epsilon written, the last round's seconds and the steady mean (rounds after this process's
    first, which pays for warm-up: kernel builds, Triton compiles, first-touch allocations), ETA
    from the steady mean. Rewritten in place on a terminal; on a log file one line per evaluation."""

    def __init__(self, total: int, enabled: bool, metric_key: str = "test_accuracy"):
        self.total, self.enabled = total, enabled
        self.metric_key, self.metric_label = metric_key, metric_key.removeprefix("test_")[:3]
        self.tty = sys.stderr.isatty()
        self.last_end, self.seconds = time.perf_counter(), []
        self.epsilon = None  # the last epsilon written (DP-FedAvg: on the rounds that evaluate)

    def update(self, round_idx: int, start_round: int, metrics: dict) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self.last_end)
        self.last_end = now
        if not self.enabled:
            return
        steady = self.seconds[1:] or self.seconds  # the first round alone: its own time
        mean = sum(steady) / len(steady)
        eta = mean * (self.total - round_idx)
        acc = metrics.get(self.metric_key)
        acc_text = f"{self.metric_label} {acc:.4f}" if acc is not None else f"{self.metric_label}   -   "
        loss = metrics["train_loss"]
        loss_text = f"{loss:.4f}" if loss is not None else "  -   (no reports)"
        if metrics.get("epsilon") is not None:
            self.epsilon = metrics["epsilon"]
        eps_text = f" | eps {self.epsilon:.3g}" if self.epsilon is not None else ""
        line = (f"round {round_idx}/{self.total} | {acc_text} | train loss {loss_text}{eps_text}"
                f" | {self.seconds[-1]:.2f} s this round, {mean:.2f} s/round steady"
                f" | ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        if self.tty:
            console.rewrite(line)
            if round_idx == self.total:
                console.end_line()
        elif acc is not None or round_idx == self.total:
            console.say(line)


def start_line(run, ranks: str, form: str, verbose: bool) -> str:
    """The run in one short line: ranks, algorithm, cohort, how clients train. The long form
    (the rules, the weighting, the aggregation's form, why the clients train as they do) with
    --verbose (FEDDDP_VERBOSE=1)."""
    schedule_words = describe_schedule(run.cfg.run, run.cfg.cohort())
    if verbose:
        ready = f"; {ready_words(run.start_phases)}" if run.start_phases else ""
        return (f"fedddp: {ranks}; {describe_algorithm(run.cfg.algorithm)}; {schedule_words}; "
                f"aggregation: {form}; {run.clients_note}{ready}")
    how = run.clients_note.split(" (", 1)[0].split(";", 1)[0]
    return (f"fedddp: {ranks}; {run.cfg.algorithm.name}; {schedule_words}; {how} "
            "(--verbose says more)")


def ready_words(phases: dict[str, float]) -> str:
    """The start's seconds in a few words: "ready in 0.42 s (data 0.21, model 0.05, ...)", each
    phase of at least 10 ms in the order it ran (prepare.StartClock)."""
    shown = ", ".join(f"{name} {s:.2f}" for name, s in phases.items() if s >= 0.01)
    return f"ready in {sum(phases.values()):.2f} s" + (f" ({shown})" if shown else "")


class Book:
    """Rank 0's bookkeeping in one place: config.toml, the start line, each round's row of
    metrics.jsonl, metrics.csv and clients.jsonl (logs.py) with its phase timings, and the
    progress line."""

    def __init__(self, run, comm):
        rc, self.run, self.world_size = run.cfg.run, run, comm.world_size
        begun = time.perf_counter()
        with outdir.disk_full_is_one_line("config.toml and metrics.jsonl", rc.out_dir, run.checkpoints.last):
            checkpoint.atomic_write_text(config.dumps(run.cfg), os.path.join(rc.out_dir, "config.toml"))
            # metrics.jsonl, metrics.csv, clients.jsonl, tensorboard/: replaced by a fresh run; a
            # resumed one's were cut back to its checkpoint's round in run()
            self.logs = logs.RunLogs(rc.out_dir, run.start_round, rc.tensorboard)
        self.progress = Progress(rc.rounds, rc.progress, run.task.metric_key)
        self.last_row: dict | None = None  # the last round's metrics.jsonl row (the closing line's epsilon)
        # run.callbacks, on rank 0: a failure here is said at round 1's end, as every callback's
        self.callbacks = callbacks.Runner(rc.callbacks)
        self.callbacks.run_start({"out_dir": rc.out_dir, "start_round": run.start_round, "rounds": rc.rounds,
                                  "config": dataclasses.asdict(run.cfg)})
        # Loads the fused CPU kernels now (built if not cached: prepare starts that build on a
        # thread) and probes their form, so round 1's aggregate_s leaves it out; the line says
        # which form of the rules produced this run's bits.
        form = run.server.describe(strategies.kernels.describe(comm.device, rule=run.strategy.name))
        run.start_phases["start line"] = time.perf_counter() - begun
        if rc.progress:
            console.say(start_line(run, comm.describe(), form, env.verbose()))
            rule_words = run.strategy.start_words and run.strategy.start_words(
                run.server.hp.params, run.cfg.expected_cohort(), run.layout.numel)
            if rule_words:
                console.say(f"fedddp: {run.strategy.name}: {rule_words}")

    def write_round(self, plan: RoundPlan, reported: list[int], train_s_R: list[float], clock: dict,
                    diagnostics: dict, train_loss, stacks: dict, test_loss, test_metric, sync: bool,
                    clients_evaluated: client_eval.Result | None = None) -> None:
        """The round's rows (fsynced when ``sync``: a checkpoint completes after them) and the
        progress line; ``clients_evaluated``: the round's client evaluation (its keys after the
        loop's, its rows to client_eval.jsonl)."""
        run, t = self.run, clock
        # test_accuracy is always a key (the output contract). The metric goes under its task's
        # key: test_accuracy itself for classification; for regression test_mae, and
        # test_accuracy stays null, as it is on rounds without evaluation.
        line = {"round": plan.round_idx, "train_loss": train_loss, "test_loss": test_loss, "test_accuracy": None,
                run.task.metric_key: test_metric, "time_s": t["checkpoint"] - t["start"],
                # rank 0's wait for slower ranks is their local training, not communication
                "train_s": max(train_s_R), "train_imbalance_s": max(train_s_R) - min(train_s_R),
                "communicate_s": max(0.0, (t["gather"] - t["start"]) - max(train_s_R))
                + (t["broadcast"] - t["aggregate"]),
                "aggregate_s": t["aggregate"] - t["gather"], "evaluate_s": t["evaluate"] - t["broadcast"],
                "checkpoint_s": t["checkpoint"] - t["evaluate"], "clients": plan.sampled,
                "num_reports": len(reported), "dropped": sorted(set(plan.sampled) - set(reported)),
                # of those, the clients that were drawn to report but planned more steps than
                # run.deadline_steps (stragglers); the others dropped out (run.dropout)
                "missed_deadline": sorted(set(plan.reporting) - set(reported))}
        if clients_evaluated is not None:
            line |= clients_evaluated.metrics
        rank_of = {c: r for r, clients in enumerate(plan.per_rank) for c in clients}
        line = self.logs.write_round(line, diagnostics, stacks, reported, rank_of, run.checkpoints.last, sync=sync,
                                     client_eval=clients_evaluated.rows if clients_evaluated is not None else None)
        self.last_row = line
        self.progress.update(plan.round_idx, run.start_round, line)

    def finish(self, last_round: int, final: dict) -> None:
        """final.pt after the last round, or the line that says how to continue a stopped run."""
        rc, last_ckpt = self.run.cfg.run, self.run.checkpoints.last
        if last_round == rc.rounds or self.callbacks.stop:  # a callback's stop ends the run as the last round
            with outdir.disk_full_is_one_line("final.pt", rc.out_dir, last_ckpt):
                checkpoint.atomic_save(final, os.path.join(rc.out_dir, "final.pt"))
            self.logs.close()
            if rc.progress:
                console.say(self.closing_line(last_round))
            return
        if last_round == rc.stop_after:
            console.say(f"fedddp: stopped after round {last_round} (run.stop_after); continue from {last_ckpt} "
                        "with run.resume=true")
        self.logs.close()

    def closing_line(self, last_round: int | None = None) -> str:
        """What a finished run leaves: the folder, its files and the server rule's closing words
        (Strategy.closing_words: DP-FedAvg's final epsilon)."""
        out_dir, rounds = self.run.cfg.run.out_dir, self.run.cfg.run.rounds
        names = [n + ("/" if os.path.isdir(os.path.join(out_dir, n)) else "") for n in
                 ("config.toml", "metrics.jsonl", "metrics.csv", "clients.jsonl", "client_eval.jsonl", "final.pt",
                  "checkpoints", "tensorboard", "client_state") if os.path.exists(os.path.join(out_dir, n))]
        closing_words = self.run.strategy.closing_words
        words = closing_words(self.last_row or {}, self.run.cfg.algorithm.params) if closing_words else ""
        done = f"finished {rounds} rounds" if last_round in (None, rounds) else \
            f"stopped after round {last_round} of {rounds} (a callback of run.callbacks)"
        return f"fedddp: {done}; {out_dir} holds {', '.join(names)}{'; ' + words if words else ''}"
