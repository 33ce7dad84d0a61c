"""The only module that calls torch.distributed.

``Comm`` wraps a process group: gloo when the run's device is the CPU, NCCL when it is CUDA (each
rank then binds ``cuda:LOCAL_RANK``). With one process and no launcher it is a fake twin that
never touches torch.distributed, so a laptop run needs no rendezvous. Collectives take and return
tensors on ``comm.device``.

Liveness: a collective waits at most ``run.collective_timeout_s`` for its peers. A rank that stops
answering (SIGSTOP, swapped out, a hung driver) would otherwise make every other rank wait out
that timeout and end in a backend traceback that names no one, so each rank runs a heartbeat
thread (``Heartbeat``): it counts up its own key in the process group's store and watches the
others' counters; a counter that has not moved for the timeout names the rank that stalled, and
the lowest live rank says so in one line before every live rank exits with ``STALLED_EXIT``.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time

import torch
import torch.distributed as dist

from . import console
from .env import ProcessEnv, write_status
from .errors import ConfigError, StalledError

STALLED_EXIT = StalledError.exit_code  # exit status of the live ranks when a rank stopped answering


class Comm:
    def __init__(self, env: ProcessEnv, device: str, timeout_s: float = 1800.0):
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        # More ranks on a node than GPUs (the thesis's 4 ranks on a 1-GPU workstation): they share
        # the GPUs round-robin over gloo, since NCCL refuses two ranks on one GPU
        self.gpus_shared = 0
        if device == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise ConfigError(f"run.device: cuda, but local rank {env.local_rank} sees 0 GPU(s); "
                                  "set run.device=cpu")
            if env.local_world_size > count:
                self.gpus_shared = count
            torch.cuda.set_device(env.local_rank % count)
            self.device = torch.device("cuda", env.local_rank % count)
        else:
            self.device = torch.device("cpu")
        self.backend = "nccl" if device == "cuda" and not self.gpus_shared else "gloo"
        # gloo takes CUDA tensors for broadcast and all_reduce only: its other collectives move
        # through host memory (FEDDDP_HOST_STAGING=1 does the same on CPU, the path's CPU twin)
        self.staged = (self.backend == "gloo" and self.device.type == "cuda") or \
            os.environ.get("FEDDDP_HOST_STAGING") == "1"
        self.link = torch.device("cpu") if self.backend == "gloo" else self.device  # where point to point moves
        self.distributed = env.source != "single"
        # A group the caller initialised (a script under torchrun calling fedddp.run) is used
        # and left open; only a group made here is destroyed by close().
        self.owns_group = self.distributed and not dist.is_initialized()
        if self.distributed and not self.owns_group:
            _check_group(env, self.backend)
        if self.owns_group:
            timeout = datetime.timedelta(seconds=timeout_s)
            start = time.monotonic()
            try:
                store, _, _ = next(dist.rendezvous(f"tcp://{env.master_addr}:{env.master_port}", env.rank,
                                                   env.world_size, timeout=timeout))
                prefix = _group_prefix(store, env.rank, env.world_size, timeout_s)
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                    raise
                raise StalledError(_not_met(env, timeout_s, _reason(exc))) from None
            try:
                dist.init_process_group(
                    self.backend, store=dist.PrefixStore(prefix, store), rank=env.rank,
                    world_size=env.world_size, device_id=self.device if self.backend == "nccl" else None,
                    timeout=timeout)
            except RuntimeError as exc:
                text, elapsed = str(exc).lower(), time.monotonic() - start
                if "timed out" not in text and "timeout" not in text and "connectfullmesh" not in text:
                    raise
                if elapsed >= timeout_s:
                    raise StalledError(_not_met(env, timeout_s, _reason(exc))) from None
                # Not the timeout: the ranks met in the store, then failed to connect to each other
                # (gloo's "timed out connecting" is its few quick retries of a refused connection).
                raise StalledError(
                    f"rank {env.rank}: the {env.world_size} ranks met at {env.master_addr}:{env.master_port} "
                    f"but could not connect to each other, after {elapsed:.1f} s of the {timeout_s:g} s "
                    f"allowed (run.collective_timeout_s): {_reason(exc)}; check that every rank can reach "
                    f"the others' addresses (GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME names the network "
                    f"interface to use)") from None
        self.heartbeat = Heartbeat(dist.distributed_c10d._get_default_store(), self.rank, self.world_size,
                                   timeout_s) if self.distributed and self.world_size > 1 else None
        # Bytes this rank has sent and received through gather_rows, broadcast_ and exchange, as
        # gloo's algorithms move them (gather: straight to the root; broadcast: a binomial tree);
        # bench/aggregation_scale.py reads them
        self.traffic = {"sent": 0, "received": 0}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather_rows(self, rows_MX: torch.Tensor, out_RMX: torch.Tensor | None) -> torch.Tensor | None:
        """[M, X] on every rank -> [world_size * M, X] on rank 0 (rank r's rows at r*M .. r*M+M-1),
        written into ``out_RMX`` (rank 0 only; None elsewhere). A gather, not an all-gather: rank 0
        is the only consumer, and over gloo an all-gather moves world_size times the bytes (on
        loopback with 2 ranks and the CNN's reports, 40 ms against 20 ms)."""
        if not self.distributed or self.world_size == 1:  # one rank (e.g. torchrun --nproc_per_node=1)
            return rows_MX
        rows_MX = self._staged(rows_MX.contiguous())
        size = rows_MX.numel() * rows_MX.element_size()
        if self.is_main:
            landing_RMX = torch.empty(out_RMX.shape, dtype=out_RMX.dtype) if self.staged else out_RMX
            dist.gather(rows_MX, list(landing_RMX.chunk(self.world_size)), dst=0)
            if landing_RMX is not out_RMX:
                out_RMX.copy_(landing_RMX)
            self.traffic["received"] += (self.world_size - 1) * size
            return out_RMX
        dist.gather(rows_MX, None, dst=0)
        self.traffic["sent"] += size
        return None

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where gloo's gather and point to point take it: a host copy when staged."""
        return tensor.to("cpu", copy=True) if self.staged else tensor

    def describe(self) -> str:
        """The start line's words on the ranks' devices."""
        if not self.gpus_shared:
            return f"{self.world_size} rank(s) on {self.device.type}"
        return (f"{self.world_size} rank(s) on {self.device.type}, {self.env.local_world_size} a node sharing "
                f"{self.gpus_shared} GPU(s) round-robin over gloo (NCCL takes one rank a GPU; gathers and "
                "point to point move through host memory)")

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.distributed:
            dist.broadcast(tensor, src)
            # gloo's broadcast is a binomial tree: relative rank v receives once and sends to
            # v + 2^j for every 2^j above its highest bit (the root: ceil(log2 W) sends)
            size, v = tensor.numel() * tensor.element_size(), (self.rank - src) % self.world_size
            sends = sum(1 for j in range(v.bit_length(), self.world_size.bit_length()) if v + (1 << j) < self.world_size)
            self.traffic["sent"] += sends * size
            self.traffic["received"] += size if v else 0
        return tensor

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        """Point to point, all posted at once, then waited for: each ``(peer, tensor)`` of ``sends``
        to that rank, each of ``recvs`` filled from that rank (contiguous tensors, none to or from
        this rank itself). Between two ranks the tensors pair up in the order given: the sender's
        sends to a rank with the receiver's receives from it. The sharded server's all-to-all of
        report columns and its all-gathers (gloo has no all_to_all): each tensor crosses once,
        straight from the rank that has it to the rank that needs it, without packing copies."""
        if not self.distributed or not (sends or recvs):
            return
        landings = [torch.empty(t.shape, dtype=t.dtype) if self.staged else t for _, t in recvs]
        ops = ([dist.P2POp(dist.isend, self._staged(t), peer) for peer, t in sends]
               + [dist.P2POp(dist.irecv, t, peer) for (peer, _), t in zip(recvs, landings)])
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for (_, t), landing in zip(recvs, landings):
            if landing is not t:
                t.copy_(landing)
        self.traffic["sent"] += sum(t.numel() * t.element_size() for _, t in sends)
        self.traffic["received"] += sum(t.numel() * t.element_size() for _, t in recvs)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_object(self, obj, src: int = 0):
        """A picklable object from ``src`` (small: metric rows, not tensors) to every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def send_tensors(self, tensors: dict[str, torch.Tensor], dst: int) -> None:
        """Named tensors to rank ``dst`` (point to point; the receiver calls ``recv_tensors``): their
        names, shapes and dtypes as one small object, then each tensor from ``comm.device``. An
        empty dict sends only the empty list, so the receiver need not know whether there is any."""
        meta = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        dist.send_object_list([meta], dst=dst, device=self.link)
        for t in tensors.values():
            dist.send(t.to(self.link).contiguous(), dst)

    def recv_tensors(self, src: int) -> dict[str, torch.Tensor]:
        """What rank ``src`` sent with ``send_tensors``, on ``comm.device``."""
        box = [None]
        dist.recv_object_list(box, src=src, device=self.link)
        received = {}
        for name, shape, dtype in box[0]:
            landing = torch.empty(shape, dtype=dtype, device=self.link)
            dist.recv(landing, src)
            received[name] = landing.to(self.device)
        return received

    def barrier(self) -> None:
        if self.distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def explain_failure(self, error: Exception) -> None:
        """After a collective raised a timeout: if a peer stalled, let the heartbeat name it (it
        ends the process); a peer that stopped mid-collective is named within one more timeout.
        A peer that died instead closes its connections, which is not a timeout: that error is
        left as it is (torchrun or srun tear the group down, or restart it)."""
        if self.heartbeat is not None and "timed out" in str(error).lower():
            self.heartbeat.wait_for_verdict()

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _group_prefix(store, rank: int, world_size: int, timeout_s: float) -> str:
    """Keys of its own for the process group about to be made in ``store``, the same on every rank.

    The store can hold an earlier group's keys: torchrun (torch 2.5 and later) hands its workers
    the agent's own store, which outlives them, so the workers it restarts after a rank died find
    the previous attempt's keys there (pytorch/pytorch#135712), and ``fedddp.run`` called twice in
    one process finds its first group's. Under a fixed prefix the new ranks read the addresses of
    processes that are gone: gloo's connectFullMesh was refused at once, or waited out the whole
    timeout for a pairing that never came, depending on which rank wrote its address first.
    TORCHELASTIC_RESTART_COUNT cannot tell attempts apart: torchrun keeps it per node (a node
    whose own workers were healthy restarts them without counting), so the ranks of one attempt
    may hold different counts.

    So rank 0 takes a new number from a counter in the store (``fedddp/groups``) and hands it to
    each rank in answer to a request only that rank's present process can have made: every other
    rank counts up its own key (``fedddp/hello/RANK``) and waits for the answer under
    ``fedddp/answer/RANK/COUNT``, a key that no process before it waited on. Rank 0 answers each
    count it reads (an earlier process's too, an answer nobody reads) until every rank has said,
    under the new number, that it has it. Raises RuntimeError (with "timed out") past
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        group = store.add("fedddp/groups", 1)
        joined, answered = f"fedddp/joined/{group}", {}
        while (arrived := store.add(joined, 0)) < world_size - 1:
            for r in range(1, world_size):
                count = store.add(f"fedddp/hello/{r}", 0)
                if count and answered.get(r) != count:
                    store.set(f"fedddp/answer/{r}/{count}", str(group))
                    answered[r] = count
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out: {arrived + 1}/{world_size} ranks arrived")
            time.sleep(0.01)
    else:
        count = store.add(f"fedddp/hello/{rank}", 1)
        answer = f"fedddp/answer/{rank}/{count}"
        try:
            store.wait([answer], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as exc:
            raise RuntimeError(f"timed out: rank 0 did not answer ({_reason(exc)})") from None
        group = int(store.get(answer))
        store.add(f"fedddp/joined/{group}", 1)
    return f"fedddp/{group}"


def _reason(exc: BaseException) -> str:
    """An exception's first line without the C++ source locations torch and gloo put in it."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"\s*\[[^\]\s]+\.(?:c|cc|cpp|cxx|h|hpp):\d+\]\s*", " ", line).strip()


def _not_met(env: ProcessEnv, timeout_s: float, reason: str) -> str:
    return (f"rank {env.rank}: the {env.world_size} ranks did not all meet at {env.master_addr}:"
            f"{env.master_port} within {timeout_s:g} s (run.collective_timeout_s): {reason}; start every "
            f"rank, with the same MASTER_ADDR and MASTER_PORT")


def _check_group(env: ProcessEnv, backend: str) -> None:
    """A process group initialised before fedddp: it must be the launcher's world and carry the
    run's backend (gloo for run.device = cpu, nccl for cuda), or every collective would fail."""
    have = dist.get_backend()
    if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
        raise ConfigError(f"environment: the process group already initialised is rank {dist.get_rank()} of "
                          f"{dist.get_world_size()}, but the launcher says rank {env.rank} of {env.world_size}; "
                          "initialise it over the whole world, or let fedddp initialise it")
    if backend not in str(have):
        raise ConfigError(f"run.device: needs a {backend} process group, but the one already initialised "
                          f"uses {have}; initialise it with backend=\"{backend}\", or let fedddp initialise it")


class Heartbeat:
    """A daemon thread: every ``interval`` seconds it adds 1 to ``fedddp/alive/RANK`` in the
    store and reads every other rank's counter (``add(key, 0)`` reads without blocking). Its own
    thread keeps beating while the main thread waits in a collective or trains (torch releases
    the GIL), so a counter stands still only if its process does. A store that stops answering
    is rank 0's: the store lives in rank 0's process (or in its node's torchrun agent)."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.interval = min(5.0, timeout_s / 10)
        now = time.monotonic()
        self.moved = {r: now for r in range(world_size) if r != rank}  # rank -> when its counter last moved
        self.store_ok = now  # when the store last answered
        self._stop, self._judged = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fedddp-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, rank: int) -> str:
        return f"fedddp/alive/{rank}"

    def _run(self) -> None:
        counts = {r: -1 for r in self.moved}
        while not self._stop.wait(self.interval):
            try:
                self.store.add(self._key(self.rank), 1)
                now_counts = {r: self.store.add(self._key(r), 0) for r in counts}
                self.store_ok = now = time.monotonic()
            except Exception:  # noqa: BLE001 -- any failure of the store means "not answering"
                now_counts, now = {}, time.monotonic()
            for r, count in now_counts.items():
                if count != counts[r]:
                    counts[r], self.moved[r] = count, now
            self._judge()

    def _judge(self) -> None:
        """Ends the process if a rank (or the store) has been silent for longer than the timeout;
        the store may also vanish for a moment at the end of a run, hence the same patience.
        Counters are judged as of the store's last answer: without the store no rank is seen, and
        only the store's host is to blame."""
        now = time.monotonic()
        stalled = [r for r, when in self.moved.items() if self.store_ok - when > self.timeout_s]
        if not stalled and now - self.store_ok > self.timeout_s:
            stalled = [0]
        if stalled and not self._stop.is_set():
            self._stalled(stalled)

    def _stalled(self, ranks: list[int]) -> None:
        """Says it once (the lowest live rank), leaves the line for the launcher, and ends this
        process at once: the main thread may be blocked in a collective that never returns."""
        if not self._judged.acquire(blocking=False):  # the thread and the main thread may both judge
            return
        live = [r for r in range(self.world_size) if r not in ranks]
        names = ", ".join(map(str, ranks))
        line = (f"fedddp: error: rank {names} stopped answering for more than {self.timeout_s:g} s "
                f"(run.collective_timeout_s); it may be stopped (SIGSTOP), swapping or hung; the run "
                f"ends here, resume it from its last checkpoint with run.resume=true")
        if live and self.rank == live[0]:
            console.say(line)
            write_status(STALLED_EXIT, line, self.rank)
        os._exit(STALLED_EXIT)

    def wait_for_verdict(self) -> None:
        """Judges (ending the process on a stall) until every peer has been heard from again,
        or one more timeout has passed: a peer that stalled before this rank's collective timed
        out is named by then, and an error of this rank's own (every peer still beating) comes
        back within a few beats. Judged here as well as in the thread, which may itself be
        blocked on a store that does not answer."""
        asked = time.monotonic()
        while time.monotonic() < asked + self.timeout_s + 3 * self.interval:
            self._judge()
            if all(when > asked for when in self.moved.values()):
                return
            time.sleep(self.interval / 2)

    def stop(self) -> None:
        self._stop.set()
