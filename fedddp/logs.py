"""The files people watch while a run goes, written by rank 0 once per round.

  metrics.jsonl   one JSON object per round: the output contract (docs/running.md)
  metrics.csv     the same rounds as a table: every key of metrics.jsonl whose value is a number
                  or null (null: an empty cell); the lists (clients, dropped, missed_deadline) are left out
  clients.jsonl   one JSON object per (round, reporting client), in client-id order: round,
                  client, rank (the rank that trained it), num_samples, num_steps, train_loss,
                  train_time_s and the server rule's per-client diagnostics. Clients that dropped
                  out or missed the deadline did not report and have no line (metrics.jsonl's
                  dropped lists them)
  client_eval.jsonl  one JSON object per (round, evaluated client), in client-id order, on the
                  rounds of client evaluation (run.client_eval_every; fedddp.client_eval): round,
                  client, rank (the rank that evaluated it), num_samples (held-out), steps (k),
                  loss and the task's metric (accuracy or mae)
  tensorboard/    event files with every number of metrics.jsonl as a scalar per round
                  (run.tensorboard = true; the optional extra fedddp[tensorboard])

A server rule's diagnostic whose name ends in a client shape (``_K``: one number per client,
``_KL``: one list per client) is per client: its rows are the report stack's, in client-id
order, and it goes to clients.jsonl under its name without the suffix (``cgw_x_K`` -> ``cgw_x``);
every other diagnostic is a key of metrics.jsonl. So metrics.jsonl stays one short line per
round at any number of clients.

Every file is appended and closed (so flushed) each round: ``tail -f`` shows each round as it
ends. A fresh run replaces them; a resumed one first drops what lies past its checkpoint's round
(a crash may have left some: ``cut_back``), so a stopped and resumed run writes the same lines as
an uninterrupted one, timings aside. A round's rows are written (and, on a checkpoint round,
fsynced) before its checkpoint is completed, so a complete checkpoint never lacks its rows.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil

import torch

from . import checkpoint, outdir
from .errors import ConfigError, DataError

JSONL = ("metrics.jsonl", "clients.jsonl", "client_eval.jsonl")
CSV = "metrics.csv"
TENSORBOARD = "tensorboard"
PER_CLIENT_SUFFIXES = ("_K", "_KL")
# one encoder for every line (json.dumps with an option makes a new one per call)
ENCODER = json.JSONEncoder(allow_nan=False)


def per_client_name(key: str) -> str | None:
    """``cgw_x_K`` -> ``cgw_x``; None for a diagnostic that is not per client."""
    for suffix in PER_CLIENT_SUFFIXES:
        if key.endswith(suffix):
            return key[:-len(suffix)]
    return None


def to_json(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    return value


def finite_or_null(value):
    """The JSON files stay JSON: a non-finite float (a test loss that overflowed, a diagnostic)
    is written as null, never as a bare NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    return value


def require_tensorboard() -> None:
    """run.tensorboard = true without the package: one ConfigError, before any data loads."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError("run.tensorboard: true needs the tensorboard package, which is not installed: "
                          "pip install 'fedddp[tensorboard]', or set run.tensorboard=false") from None


class RunLogs:
    """Rank 0's per-round files in ``out_dir`` (see the module doc), opened once the run knows
    its first round."""

    def __init__(self, out_dir: str, start_round: int, tensorboard: bool):
        self.out_dir = out_dir
        self.path = {name: os.path.join(out_dir, name) for name in JSONL + (CSV,)}
        tb_dir = os.path.join(out_dir, TENSORBOARD)
        if start_round == 1:
            for path in self.path.values():
                if os.path.exists(path):
                    os.remove(path)
            if os.path.isdir(tb_dir):
                shutil.rmtree(tb_dir)
        # a resumed run's files were cut back to its checkpoint by cut_back, before any data loaded
        self.columns = _csv_header(self.path[CSV])
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # the optional extra, only when asked for
            # purge_step: TensorBoard itself hides the events of rounds past the checkpoint
            self.writer = SummaryWriter(tb_dir, purge_step=start_round if start_round > 1 else None)

    def write_round(self, line: dict, diagnostics: dict, stacks: dict, reported: list[int],
                    rank_of: dict[int, int], last_ckpt: str | None, sync: bool = False,
                    client_eval: list[dict] | None = None) -> dict:
        """Writes round ``line["round"]`` to every file and returns its metrics.jsonl object.
        ``line`` holds the round loop's keys, ``diagnostics`` the server rule's tensors (or
        their host values), ``stacks`` the report stacks of the ``reported`` clients (rows in
        client-id order; empty when none reported), as tensors or as the host lists the round
        read them into (server.read_once), ``rank_of`` each client's training rank. ``sync``: fsync
        the files (a checkpoint of this round is completed next and must not outlive its rows
        in a power cut). ``client_eval``: the round's client_eval.jsonl objects (client evaluation)."""
        per_client = {name: v for k, v in diagnostics.items() if (name := per_client_name(k))}
        line = line | {k: to_json(v) for k, v in diagnostics.items() if not per_client_name(k)}
        line = {k: finite_or_null(v) for k, v in line.items()}
        self._append("metrics.jsonl", ENCODER.encode(line) + "\n", last_ckpt, sync)
        self._append_csv(line, last_ckpt, sync)
        if reported:
            self._append("clients.jsonl", _client_lines(line["round"], reported, rank_of, stacks, per_client),
                         last_ckpt, sync)
        if client_eval:
            self._append("client_eval.jsonl", "".join(ENCODER.encode({k: finite_or_null(v) for k, v in row.items()})
                                                      + "\n" for row in client_eval), last_ckpt, sync)
        if self.writer is not None:
            with outdir.disk_full_is_one_line(TENSORBOARD, self.out_dir, last_ckpt):
                for key, value in line.items():
                    if key != "round" and isinstance(value, (int, float)) and not isinstance(value, bool):
                        self.writer.add_scalar(key, value, line["round"])
                self.writer.flush()
        return line

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _append(self, name: str, text: str, last_ckpt: str | None, sync: bool = False) -> None:
        with outdir.disk_full_is_one_line(name, self.out_dir, last_ckpt), open(self.path[name], "a") as fh:
            fh.write(text)
            if sync:
                fh.flush()
                os.fsync(fh.fileno())

    def _append_csv(self, line: dict, last_ckpt: str | None, sync: bool = False) -> None:
        row = {k: v for k, v in line.items() if not isinstance(v, list)}
        new = [k for k in row if k not in (self.columns or [])]
        if not new:
            self._append(CSV, _csv_text([row], self.columns, header=False), last_ckpt, sync)
            return
        # A key first seen now (the first round, or a rule's diagnostics after rounds without
        # reports): the file is rewritten once with the wider header, so every row has the same
        # columns and earlier rows an empty cell for it.
        rows = _csv_rows(self.path[CSV]) + [row]
        self.columns = (self.columns or []) + new
        with outdir.disk_full_is_one_line(CSV, self.out_dir, last_ckpt):
            checkpoint.atomic_write_text(_csv_text(rows, self.columns, header=True), self.path[CSV])


def _client_lines(round_idx: int, reported: list[int], rank_of: dict[int, int], stacks: dict,
                  per_client: dict) -> str:
    """The round's clients.jsonl lines as one string (one write for any number of clients). The
    columns come as host lists (the round loop reads them from the device once, with its checks:
    server.read_once) or as tensors, read here."""
    columns = {"train_loss": stacks["train_loss_K"], "train_time_s": stacks["train_time_K"]} | per_client
    # .tolist(), not to_json: one reporting client still gives a list of one row
    columns = {name: _host_list(rows) for name, rows in columns.items()}
    for name, rows in columns.items():
        assert len(rows) == len(reported), f"{name}: {len(rows)} rows for {len(reported)} clients"
    # one check on the values spares the per-value walk in the usual all-finite round
    finite = all(math.isfinite(v) for rows in columns.values() for v in _flat(rows))
    num_samples, num_steps = _host_list(stacks["num_samples_K"]), _host_list(stacks["num_steps_K"])
    lines = []
    for i, cid in enumerate(reported):
        record = {"round": round_idx, "client": cid, "rank": rank_of[cid], "num_samples": int(num_samples[i]),
                  "num_steps": int(num_steps[i])} | {name: values[i] for name, values in columns.items()}
        if not finite:
            record = {k: finite_or_null(v) for k, v in record.items()}
        lines.append(ENCODER.encode(record))
    return "\n".join(lines) + "\n"


def _host_list(rows) -> list:
    return rows.detach().cpu().tolist() if isinstance(rows, torch.Tensor) else rows


def _flat(rows: list):
    for v in rows:
        if isinstance(v, list):
            yield from _flat(v)
        else:
            yield v


def _csv_text(rows: list[dict], columns: list[str], header: bool) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    if header:
        writer.writerow(columns)
    # repr of a float is the shortest text that reads back to it, as in metrics.jsonl
    writer.writerows([["" if row.get(k) is None else row[k] for k in columns] for row in rows])
    return buffer.getvalue()


def _csv_header(path: str) -> list[str] | None:
    if not os.path.exists(path):
        return None
    with open(path, newline="") as fh:
        return next(csv.reader(fh), None)


def _csv_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _whole_lines(path: str) -> list[tuple[int, str]]:
    """(line number, line) of the file's lines that end in a newline: a run killed in the middle
    of a round's write (clients.jsonl's can be large) leaves a last line cut short, which is no
    record. A line that is not UTF-8 text is damaged."""
    lines = []
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if raw.endswith(b"\n") and raw.strip():
                try:
                    lines.append((number, raw.decode()))
                except UnicodeDecodeError:
                    raise _damaged(path, number, "not UTF-8 text") from None
    return lines


def _damaged(path: str, number: int, what: str) -> DataError:
    return DataError(f"{path}: line {number} is damaged ({what}), so the run's rows cannot be cut back to "
                     "its checkpoint; repair that line and resume again, or start over with "
                     "run.resume=false run.overwrite=true")


def cut_back(kept: dict[str, list[str]]) -> None:
    """On resume (rank 0, before any data loads): rewrite metrics.jsonl, clients.jsonl,
    client_eval.jsonl and metrics.csv with ``kept_rows``' lines, those of the checkpoint's round
    and before (a crash may have left rows past it)."""
    for path, lines in kept.items():
        checkpoint.atomic_write_text("".join(lines), path)


def kept_rows(out_dir: str, last_round: int) -> dict[str, list[str]]:
    """Each of metrics.jsonl, clients.jsonl, client_eval.jsonl and metrics.csv (those present) ->
    its lines up to ``last_round``, read and changing nothing: a damaged line is one DataError
    naming its file and line before anything is rewritten (and ``python -m fedddp --check``
    refuses it too)."""
    kept = {}
    for name in JSONL:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        kept[path] = []
        for number, line in _whole_lines(path):
            try:
                round_idx = json.loads(line)["round"]
                if not isinstance(round_idx, int):
                    raise TypeError
            except ValueError:
                raise _damaged(path, number, "not JSON") from None
            except (KeyError, TypeError):
                raise _damaged(path, number, "no integer round") from None
            if round_idx <= last_round:
                kept[path].append(line)
    path = os.path.join(out_dir, CSV)
    rows = [(number, next(csv.reader([line]))) for number, line in _whole_lines(path)] if os.path.exists(path) else []
    if rows:
        (number, header), keep = rows[0], [rows[0][1]]
        if "round" not in header:
            raise _damaged(path, number, "its header has no round column")
        at = header.index("round")
        for number, row in rows[1:]:
            try:
                round_idx = int(row[at])
            except (IndexError, ValueError):
                raise _damaged(path, number, "no round number in its round column") from None
            if round_idx <= last_round:
                keep.append(row)
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(keep)
        kept[path] = [buffer.getvalue()]
    return kept
