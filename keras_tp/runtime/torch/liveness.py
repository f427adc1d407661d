"""Which torch rank was lost, when a collective fails.

gloo reports a dead peer as "Connection reset by peer [10.0.0.7]:41231" and
a frozen one as "Timed out waiting 30000ms for recv operation": a socket
or nothing, never a rank. So every rank of a multi-rank group records
itself in the rendezvous store (the `MASTER_ADDR:MASTER_PORT` TCPStore,
which torchrun's agent or `keras_tp.launch` hosts): its pid and
host once, and a heartbeat counter that a daemon thread increments every
second. When a collective fails, the rank that saw it asks:

- ranks on this host: is the process gone, a zombie, or stopped
  (SIGSTOP, a debugger)?
- every rank: did its heartbeat counter stop moving for a few beats?
- the store itself: does it still answer? If not, the process that
  hosted it is gone (rank 0 under `launch`, the agent under torchrun).

and raises a `RankLostError` naming what it found. When nothing is lost
but the collective timed out, the ranks are alive but stuck: the rank asks
every rank for a report (which collectives it entered, and its Python
stack; its heartbeat thread answers) and raises a `RankStuckError` naming
the ranks that never entered the collective (`stuck`).
"""

import datetime
import json
import logging
import os
import re
import socket
import threading
import time

import torch.distributed as dist

from keras_tp import elastic
from keras_tp.collectives import recorder
from keras_tp.errors import RankLostError
from keras_tp.runtime.torch import stuck

logger = logging.getLogger(__name__)

# Seconds between heartbeats, and how many missed ones mean a lost rank.
HEARTBEAT_SECONDS = 1.0
MISSED_HEARTBEATS = 3
# Seconds a store request may take before the store counts as gone.
_STORE_SECONDS = 5.0

# Text of gloo's and NCCL's errors when a peer is gone or late.
_COLLECTIVE_FAILURES = (
    "gloo",
    "NCCL",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out waiting",
)
# Text of a collective's error when it waited out its timeout.
_TIMEOUTS = ("Timed out", "timed out", "Timeout", "timeout")

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")

_WATCH = None


def watch_ranks():
    """Records this rank in the store and starts its heartbeat.

    Called by `join_process_group` once the default process group exists;
    does nothing in a group of one rank, in a group not rendezvoused
    through `MASTER_ADDR`/`MASTER_PORT`, or if already watching. Also makes
    an uncaught collective failure end as a `RankLostError`
    (`keras_tp.elastic.install_failure_hook`).
    """
    global _WATCH
    if _WATCH is not None or dist.get_world_size() < 2:
        return
    if not {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        return
    try:
        _WATCH = _RankWatch(dist.get_rank(), dist.get_world_size())
    except Exception as e:
        # Naming lost ranks is a diagnosis: training goes on without it.
        logger.warning(
            "keras_tp cannot record rank %d in the rendezvous store (%s); "
            "a failed collective will not name the lost rank.",
            dist.get_rank(),
            e,
        )
        return
    elastic.install_failure_hook(rank_lost_error)


def stop_watching():
    """Stops this rank's heartbeat (the process is leaving its group)."""
    global _WATCH
    if _WATCH is not None:
        _WATCH.stop()
        _WATCH = None
    recorder.reset()


def rank_lost_error(error):
    """The error naming the ranks that made collective `error` happen.

    Args:
        error: an exception raised in this rank.

    Returns:
        A `RankLostError` (not raised) if `error` is a failed collective and
        some rank is gone or stopped responding; a `RankStuckError` if it
        timed out while every rank is alive, naming the ranks that never
        entered it; else `None`.
    """
    if _WATCH is None or not _is_collective_failure(error):
        return None
    timed_out = any(marker in str(error) for marker in _TIMEOUTS)
    lost = _WATCH.lost_ranks(ask_reports=timed_out)
    me = _WATCH.rank
    reported = _reported_line(error).rstrip(".")
    if not lost:
        if not timed_out:
            return None
        return stuck.stuck_error(
            me, error, reported, _WATCH.reports, time.time()
        )
    names = "; ".join(f"rank {r} {why}" for r, why in sorted(lost.items()))
    timeout = elastic.collective_timeout()
    waited = (
        f"{timeout:g} s ({elastic.COLLECTIVE_TIMEOUT_VARIABLE})"
        if timeout
        else f"torch's default (set {elastic.COLLECTIVE_TIMEOUT_VARIABLE})"
    )
    return RankLostError(
        f"Rank {me}: a collective failed because {names}. The collective's "
        f"error: {type(error).__name__}: {reported}. Collectives wait "
        f"for the other ranks at most {waited}. To go on without "
        "restarting by hand, run with keras_tp.launch(..., max_restarts=N) "
        "or torchrun --max-restarts N and resume from your last checkpoint "
        "in the training function.",
        ranks=sorted(lost),
        rank=me,
    )


def agent_store():
    """Whether the agent (torchrun or `launch`) hosts the store, not rank 0."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _reported_line(error):
    """The line of `error`'s message that says what the backend saw.

    Keras wraps a layer's error in "Exception encountered when calling
    ...", with the backend's message, in bold, a few lines below.
    """
    lines = [
        _ANSI_ESCAPE.sub("", line).strip() for line in str(error).splitlines()
    ]
    lines = [line for line in lines if line]
    for line in lines:
        if any(marker in line for marker in _COLLECTIVE_FAILURES):
            return line[:300]
    return lines[0][:300] if lines else "(no message)"


def _is_collective_failure(error):
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in _COLLECTIVE_FAILURES
    )


class _RankWatch:
    """This rank's record and heartbeat in the store; the diagnosis."""

    def __init__(self, rank, world_size):
        self.rank = rank
        self.world_size = world_size
        self.address = (
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        )
        # torchrun's agent or `launch` hosts the store, or else rank 0.
        self.agent_store = agent_store()
        self.host = socket.gethostname()
        # Restarts under torchrun may keep the agent's store: keys of an
        # earlier attempt must not count.
        self._prefix = (
            f"keras_tp/liveness/{elastic.restart_count()}/{world_size}/"
        )
        self._store = self._connect()
        self._store.set(
            self._key("rank", rank),
            json.dumps({"pid": os.getpid(), "host": self.host}),
        )
        self._store.add(self._key("beats", rank), 1)
        # The last request for reports this rank answered, and the reports
        # of the other ranks its last diagnosis received.
        self._answered = 0
        self.reports = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="keras_tp-heartbeat", daemon=True
        )
        self._thread.start()

    def _connect(self):
        # A client of its own: the process group's store is busy in the
        # main thread, and a request here must fail fast.
        host, port = self.address.rsplit(":", 1)
        return dist.TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=_STORE_SECONDS),
            wait_for_workers=False,
        )

    def _key(self, kind, rank):
        return f"{self._prefix}{kind}/{rank}"

    def _beat(self):
        while not self._stopping.wait(HEARTBEAT_SECONDS):
            try:
                self._store.add(self._key("beats", self.rank), 1)
                self._answer()
            except Exception:
                # The store's host left (the job is ending, or it died):
                # the diagnosis reports it when a collective fails.
                return

    def _answer(self):
        """Sends this rank's report if a failed collective asked for one
        since the last beat (`stuck.report`)."""
        request = self._store.add(self._key("request", "all"), 0)
        if request > self._answered:
            self._answered = request
            self._store.set(
                self._key("report", self.rank),
                json.dumps(stuck.report(request)),
            )

    def _reports(self, store, ranks, request):
        """`{rank: report}` of the ranks that answered `request`."""
        reports = {}
        for rank in ranks:
            key = self._key("report", rank)
            if store.check([key]):
                answer = json.loads(store.get(key))
                if answer["request"] >= request:
                    reports[rank] = answer
        return reports

    def stop(self):
        self._stopping.set()
        self._thread.join(timeout=_STORE_SECONDS)

    def lost_ranks(self, ask_reports=False):
        """`{rank: why}` of the ranks that are gone or not responding.

        With `ask_reports`, the ranks that still beat are also asked for
        their reports, which land in `self.reports`.
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        self.reports = {}
        try:
            store = self._connect()
            records = {}
            for rank in others:
                key = self._key("rank", rank)
                if store.check([key]):
                    records[rank] = json.loads(store.get(key))
            lost = {}
            for rank, record in records.items():
                if record["host"] == self.host:
                    state = _process_state(record["pid"])
                    if state is not None:
                        lost[rank] = f"(pid {record['pid']}) {state}"
            if lost:
                return lost
            # Ranks elsewhere, or alive here but stuck: do their
            # heartbeats still move? Their reports come in meanwhile.
            if ask_reports:
                request = store.add(self._key("request", "all"), 1)
            before = {r: store.add(self._key("beats", r), 0) for r in others}
            time.sleep(MISSED_HEARTBEATS * HEARTBEAT_SECONDS)
            after = {r: store.add(self._key("beats", r), 0) for r in others}
            if ask_reports:
                self.reports = self._reports(store, others, request)
        except Exception as e:
            return self._store_gone(e)
        for rank in others:
            if after[rank] == before[rank]:
                record = records.get(rank)
                where = (
                    f"(pid {record['pid']} on {record['host']}) "
                    if record
                    else ""
                )
                lost[rank] = (
                    f"{where}stopped responding: no heartbeat for "
                    f"{MISSED_HEARTBEATS * HEARTBEAT_SECONDS:g} s"
                )
        return lost

    def _store_gone(self, error):
        if self.agent_store:
            # Every rank of the agent's node is gone with it; which ranks
            # those were is in the agent's store, gone too.
            logger.error(
                "Rank %d: the store of the agent that started the ranks "
                "(torchrun's or keras_tp.launch's) at %s no longer answers "
                "(%s): its node is gone.",
                self.rank,
                self.address,
                error,
            )
            return {}
        return {
            0: (
                f"is gone: it hosted the rendezvous store at {self.address}, "
                "which no longer answers"
            )
        }


def _process_state(pid):
    """Why process `pid` of this host cannot answer, or `None` if it can."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which is in parentheses.
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "is gone: its process exited"
    except (OSError, IndexError):
        # No /proc (macOS): signal 0 tells whether the pid exists.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "is gone: its process exited"
        except PermissionError:
            pass
        return None
    if state in ("Z", "X"):
        return "is gone: its process exited"
    if state in ("T", "t"):
        return "is stopped (SIGSTOP or a debugger) and cannot answer"
    return None
