"""What the training loop does about preemption and stalls.

``StopRequest``: SIGTERM (preemption, ``scancel``, a pod deletion, torchrun shutting its workers
down) sets a flag; the loop agrees on it with the other ranks at the next step, writes a
checkpoint and exits with ``EXIT_STOPPED``.

``Watchdog``: a thread per rank that fails the job, naming the stalled rank, when no rank has
made progress for ``timeout_s`` seconds. The main thread only records where it is (a counter,
the step and a phase: plain attribute writes); the thread publishes that to the job's store and,
once its own rank stops moving, reads the others' to see whether anyone still moves. The ranks
furthest behind are the stalled ones; the others are waiting for them in a collective.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from wdsdist.cluster.distributed import after_loss

EXIT_STOPPED = 143  # 128 + SIGTERM, what a shell reports for a terminated process: stopped, not finished
EXIT_STALLED = 1

# Where a rank is within one step, in the order a step goes through them (see Watchdog.beat).
PHASES = ("eval", "eval-wait", "checkpoint", "data", "step")
DOING = {
    "eval": "evaluating",
    "eval-wait": "waiting for the others to finish evaluating",
    "checkpoint": "writing a checkpoint",
    "data": "waiting for its next batch",
    "step": "in the training step (forward, backward, all-reduce)",
    "start": "starting",
}


class StopRequest:
    """SIGTERM sets ``requested``; the loop stops at the next step every rank agrees on."""

    def __init__(self) -> None:
        self.requested = False
        self.watchdog: Watchdog | None = None
        self._previous: Any = None

    def install(self) -> StopRequest:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self.watchdog is not None and self.watchdog.fired.is_set():
            os._exit(EXIT_STALLED)  # the job is stalled: no step boundary will come

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class Watchdog:
    """Fails the job when no rank makes progress for ``timeout_s`` seconds (see the module doc)."""

    def __init__(
        self, rank: int, world: int, timeout_s: float, store: Any, prefix: str, stop: StopRequest | None = None
    ):
        self.rank, self.world, self.timeout_s, self.store = rank, world, timeout_s, store
        self.prefix, self.stop = prefix, stop
        self.state: tuple[int, int, str] = (0, 0, "start")  # beats, steps done, phase
        self.fired = threading.Event()
        self._closed = threading.Event()
        self.period = self.period_for(timeout_s)
        self._thread = threading.Thread(target=self._run, name="wdsdist-watchdog", daemon=True)
        if stop is not None:
            stop.watchdog = self

    @staticmethod
    def period_for(timeout_s: float) -> float:
        """Seconds between two looks (also the most one store call may take)."""
        return max(0.2, min(5.0, timeout_s / 5))

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self, steps: int, phase: str) -> None:
        """Called by the training loop at every phase and evaluation batch; no I/O."""
        self.state = (self.state[0] + 1, steps, phase)

    def close(self) -> None:
        self._closed.set()

    # ---- the thread

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _publish(self, state: tuple[int, int, str]) -> None:
        self.store.set(self._key(self.rank), " ".join(map(str, state)))

    def _read_all(self) -> dict[int, tuple[int, int, str]]:
        keys = [self._key(r) for r in range(self.world)]
        # One check for all (a get of a missing key would block); one by one only while some
        # rank has not published yet.
        have = (
            list(range(self.world))
            if self.store.check(keys)
            else [r for r, k in enumerate(keys) if self.store.check([k])]
        )
        values = self.store.multi_get([keys[r] for r in have]) if have else []
        states = {}
        for r, raw in zip(have, values, strict=True):
            beats, steps, phase = raw.decode().split()
            states[r] = (int(beats), int(steps), phase)
        return states

    def _run(self) -> None:
        seen: dict[int, int] = {}  # rank -> beats when last seen
        known: dict[int, tuple[int, int, str]] = {}  # rank -> state when last read
        last_move = time.monotonic()
        published = None
        store = _Bounded(self.period)
        silent = False  # the store's last call failed or did not come back
        wait = 0.0  # the first look at once: the others hear of this rank before anything can cut it off
        while not self._closed.wait(wait):
            wait = self.period
            mine = self.state
            fresh = {self.rank: mine}
            try:
                if self.store is not None and mine != published:
                    store(lambda mine=mine: self._publish(mine))
                    published = mine
                if self.store is not None and seen.get(self.rank) == mine[0]:
                    fresh = store(self._read_all) | fresh  # only while this rank stands still
                silent = False
            except Exception:  # the store is gone or cut off (or the agent is shutting down): judge this rank alone
                silent = self.store is not None
            known.update(fresh)
            moved = [r for r, s in fresh.items() if seen.get(r) != s[0]]
            for r in moved:
                seen[r] = fresh[r][0]
            now = time.monotonic()
            if moved:
                last_move = now
            elif now - last_move >= self.timeout_s:
                self._fire(known, now - last_move, silent)
                return

    def _fire(self, states: dict[int, tuple[int, int, str]], idle: float, silent: bool = False) -> None:
        self.fired.set()
        if silent:  # no word from the others: this rank speaks for itself, at once
            limit = f"no progress for {idle:.0f}s (trainer.timeout_s={self.timeout_s:g})"
            _, steps, phase = self.state
            print(
                f"error: rank {self.rank} lost contact with the job: {limit}, {DOING.get(phase, phase)} at step "
                f"{steps + 1}, and the job's store does not answer (this node or the one holding it is cut off); "
                f"{after_loss()}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_STALLED)
        message = f"{stall_message(states, self.world, idle, self.timeout_s)}; {after_loss()}"
        behind = stalled_ranks(states, self.world)
        ahead = [r for r in range(self.world) if r not in behind]
        reporter = ahead[0] if ahead else 0
        if self.rank != reporter:
            # The reporter prints and exits, and torchrun stops this rank (SIGTERM, see
            # StopRequest). Should the reporter be gone, say it here after another timeout.
            if self.stop is not None and self.stop.requested:
                os._exit(EXIT_STALLED)
            if self._closed.wait(self.timeout_s):
                return
            message += f" (reported by rank {self.rank})"
        print(f"error: {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_STALLED)


class _Bounded:
    """Store calls run on a thread of their own and waited for at most ``limit`` seconds: with
    its host cut off, a TCPStore call can block for good (its timeout bounds waits for keys, not
    a request whose answer never comes), and the watchdog must still judge. While a call is
    stuck, later ones fail at once instead of piling up threads."""

    def __init__(self, limit: float):
        self.limit = limit
        self._stuck: threading.Thread | None = None

    def __call__(self, fn: Callable[[], Any]) -> Any:
        if self._stuck is not None and self._stuck.is_alive():
            raise TimeoutError("the job's store has not answered")
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc

        thread = threading.Thread(target=call, name="wdsdist-watchdog-store", daemon=True)
        thread.start()
        thread.join(self.limit)
        if thread.is_alive():
            self._stuck = thread
            raise TimeoutError(f"the job's store did not answer within {self.limit:g}s")
        if "error" in box:
            raise box["error"]
        return box.get("value")


def _position(state: tuple[int, int, str]) -> tuple[int, int]:
    _, steps, phase = state
    return (steps, PHASES.index(phase) if phase in PHASES else -1)


def stalled_ranks(states: dict[int, tuple[int, int, str]], world: int) -> list[int]:
    """The ranks furthest behind (never heard from counts as furthest)."""
    missing = [r for r in range(world) if r not in states]
    if missing:
        return missing
    low = min(_position(s) for s in states.values())
    return [r for r in sorted(states) if _position(states[r]) == low]


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def stall_message(states: dict[int, tuple[int, int, str]], world: int, idle: float, timeout_s: float) -> str:
    behind = stalled_ranks(states, world)
    limit = f"no progress for {idle:.0f}s (trainer.timeout_s={timeout_s:g})"
    if any(r not in states for r in behind):
        return f"{_ranks(behind)} never reached the training loop: {limit}"
    _, steps, phase = states[behind[0]]
    where = f"{DOING.get(phase, phase)} at step {steps + 1}"
    if world == 1:
        return f"stalled: {limit}, {where}"
    if len(behind) == world:
        return f"every rank stalled: {limit}, all {where}"
    others = [r for r in range(world) if r not in behind]
    wait = ("waits" if len(others) == 1 else "wait") + (" for it" if len(behind) == 1 else " for them")
    return f"{_ranks(behind)} stalled: {limit}, {where}; {_ranks(others)} {wait}"


def stall_for_test(rank: int, steps: int) -> None:
    """TEST HOOK: WDSDIST_TEST_STALL_RANK=R and WDSDIST_TEST_STALL_STEP=S make rank R stop for
    good before step S, as a hung file system or a dead data server would (tests/train/test_faults_train.py)."""
    if os.environ.get("WDSDIST_TEST_STALL_RANK") == str(rank) and os.environ.get("WDSDIST_TEST_STALL_STEP") == str(
        steps + 1
    ):
        threading.Event().wait()


def hold_for_test(rank: int, steps: int, generation: int, stop_requested: Callable[[], bool]) -> None:
    """TEST HOOK: WDSDIST_TEST_HOLD=PATH and WDSDIST_TEST_HOLD_STEP=S make every rank of the
    job's G-th start, before step S, write its pid to PATH.gG.rank-R and wait while PATH.gG
    exists and no stop is requested, so a test can fault a node at a known step of a known start
    (tests/cluster/test_cluster_faults.py): every rank is between two steps, the checkpoints before S
    written."""
    hold = os.environ.get("WDSDIST_TEST_HOLD")
    if hold and os.environ.get("WDSDIST_TEST_HOLD_STEP") == str(steps + 1):
        path = f"{hold}.g{generation}"
        if os.path.exists(path):
            with open(f"{path}.rank-{rank}", "w", encoding="utf-8") as f:
                f.write(f"{os.getpid()}\n")
            while os.path.exists(path) and not stop_requested():
                time.sleep(0.05)


def trace_for_test(rank: int, step: int, batch: dict, generation: int) -> None:
    """TEST HOOK: WDSDIST_TEST_TRACE=DIR makes each rank append, per step it trains, the step, the
    batch's epoch and its samples' positions (split=samples) to DIR/start-G/rank-R.txt (G: the
    job's start in its run directory), so a test can check which samples a run delivered, also
    across restarts (tests/train/test_train_elastic.py, tests/cluster/test_cluster_faults.py)."""
    where = os.environ.get("WDSDIST_TEST_TRACE")
    if where:
        folder = os.path.join(where, f"start-{generation}")
        os.makedirs(folder, exist_ok=True)
        epochs = sorted(set(batch["id"][:, 0].tolist()))
        with open(os.path.join(folder, f"rank-{rank}.txt"), "a", encoding="utf-8") as f:
            f.write(f"{step} {','.join(map(str, epochs))} {','.join(map(str, batch['pos'].tolist()))}\n")


def pixels_for_test(rank: int, step: int, batches: list[dict]) -> None:
    """TEST HOOK: WDSDIST_TEST_PIXELS=DIR makes each rank append, per sample it trains on, the
    step, the micro-batch, the sample's epoch, position and a CRC of its uint8 pixels (as the
    loader gave them, before mixing) to DIR/rank-R.txt, so a test can hold a resumed run's
    pixels to the uninterrupted run's (tests/train/test_recipe_exact.py)."""
    where = os.environ.get("WDSDIST_TEST_PIXELS")
    if not where:
        return
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, f"rank-{rank}.txt"), "a", encoding="utf-8") as f:
        for micro, batch in enumerate(batches):
            images = batch["image"].cpu()
            for row in range(len(images)):
                crc = zlib.crc32(images[row].contiguous().numpy().tobytes())
                size = images.shape[-1]
                epoch, pos = int(batch["id"][row, 0]), int(batch["pos"][row])
                f.write(f"{step} {micro} {epoch} {pos} {size} {crc:08x}\n")


def kill_for_test(rank: int, written: int) -> None:
    """TEST HOOK: WDSDIST_TEST_KILL_RANK=R and WDSDIST_TEST_KILL_AFTER=N make rank R of a
    prediction job kill itself (SIGKILL, as the OOM killer or a lost node would) once it has
    written N parts or pieces, so a test can restart the job from a known state
    (tests/predict/test_predict_dist.py)."""
    after = os.environ.get("WDSDIST_TEST_KILL_AFTER")
    if after and os.environ.get("WDSDIST_TEST_KILL_RANK") == str(rank) and written >= int(after):
        os.kill(os.getpid(), signal.SIGKILL)
