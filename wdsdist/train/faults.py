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
from typing import Any

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
        self.period = max(0.2, min(5.0, timeout_s / 5))
        self._thread = threading.Thread(target=self._run, name="wdsdist-watchdog", daemon=True)
        if stop is not None:
            stop.watchdog = self

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
        while not self._closed.wait(self.period):
            mine = self.state
            fresh = {self.rank: mine}
            try:
                if self.store is not None and mine != published:
                    self._publish(mine)
                    published = mine
                if self.store is not None and seen.get(self.rank) == mine[0]:
                    fresh = self._read_all() | fresh  # only while this rank stands still
            except Exception:  # the store is gone (the agent is shutting down): judge this rank alone
                pass
            known.update(fresh)
            moved = [r for r, s in fresh.items() if seen.get(r) != s[0]]
            for r in moved:
                seen[r] = fresh[r][0]
            now = time.monotonic()
            if moved:
                last_move = now
            elif now - last_move >= self.timeout_s:
                self._fire(known, now - last_move)
                return

    def _fire(self, states: dict[int, tuple[int, int, str]], idle: float) -> None:
        message = stall_message(states, self.world, idle, self.timeout_s)
        behind = stalled_ranks(states, self.world)
        ahead = [r for r in range(self.world) if r not in behind]
        reporter = ahead[0] if ahead else 0
        self.fired.set()
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
    good before step S, as a hung file system or a dead data server would (tests/test_faults_train.py)."""
    if os.environ.get("WDSDIST_TEST_STALL_RANK") == str(rank) and os.environ.get("WDSDIST_TEST_STALL_STEP") == str(
        steps + 1
    ):
        threading.Event().wait()


def trace_for_test(rank: int, step: int, batch: dict) -> None:
    """TEST HOOK: WDSDIST_TEST_TRACE=DIR makes each rank append, per step it trains, the step, the
    batch's epoch and its samples' positions (split=samples) to DIR/rank-R.txt, so a test can
    check which samples a run delivered (tests/test_train_elastic.py)."""
    where = os.environ.get("WDSDIST_TEST_TRACE")
    if where:
        epochs = sorted(set(batch["id"][:, 0].tolist()))
        with open(os.path.join(where, f"rank-{rank}.txt"), "a", encoding="utf-8") as f:
            f.write(f"{step} {','.join(map(str, epochs))} {','.join(map(str, batch['pos'].tolist()))}\n")
