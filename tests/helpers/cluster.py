"""A cluster on one machine, for the fault scenarios (tests/cluster/test_cluster_faults.py, ./run chaos).

Each node is a network namespace with its own veth link to a bridge; a head namespace runs the
rendezvous store (a standalone c10d TCPStore, as a cluster's rendezvous service would be, so it
does not die with a worker node); a store namespace serves the shards over HTTP. One torchrun
agent runs per node; the run directory is a folder every node sees, as a shared file system
would be. Addresses come from 198.18.0.0/15 (the benchmarking range) and nothing else is ever a
target: the namespaces have no route out. Links can be taken down (a partition) and rate-limited
(tbf; this kernel has no netem).

Needs root (CAP_NET_ADMIN) and iproute2; ``unavailable()`` says in one line why not otherwise.
Every namespace, link and process made here is removed on exit, also when a test fails, and a
slot left behind by a killed run is cleaned up by the next one that takes it.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# The checkout (tests/conftest.py's ROOT), not imported from there: the store's HTTP server and the
# delay relay run this module in processes of their own, which need no torch.
ROOT = Path(__file__).resolve().parents[2]
SLOTS = 512  # a /24 each: 198.18.0.0/24 .. 198.19.255.0/24, all of 198.18.0.0/15
LOCKS = Path("/run/wdsdist-cluster")
RDZV_PORT, HTTP_PORT, DELAY_PORT = 29400, 8080, 8081
# The rendezvous settles in about a second once a node is gone (3 missed 1-second heartbeats):
# torchrun's defaults (30 s last call, 5 s x 3 heartbeats) are for real clusters.
FAST_RDZV = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip and tc): apt-get install iproute2"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add): run as root"
    probe = f"wdsprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    _ip("netns", "delete", probe, check=False)
    return None


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        out.setdefault(ppid, []).append(int(entry))
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun's workers are in sessions of their own, so a
    process group does not reach them; the parent links do)."""
    children, found, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant, as a node losing power would; again until none is
    left (a process may fork while the first pass runs)."""
    for _ in range(20):
        alive = [p for p in tree(pid) if os.path.exists(f"/proc/{p}")]
        if not alive or (alive == [pid] and _is_zombie(pid)):
            return
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def ended(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie its stuck parent has not reaped counts as ended)."""
    return _is_zombie(pid)


class Cluster:
    """``nodes`` node namespaces, a head (rendezvous) and a store (HTTP) namespace on one bridge.

    Use as a context manager; ``work`` holds the logs (``logs/NAME.log``)."""

    def __init__(self, nodes: int, work: Path, serve: Path | None = None):
        self.nodes, self.work, self.serve = nodes, Path(work), serve
        self.procs: dict[str, subprocess.Popen] = {}
        self.slot = -1
        self._lock = None

    # ---- names and addresses

    def _net(self) -> str:
        return f"198.{18 + self.slot // 256}.{self.slot % 256}"

    def ns(self, who: str) -> str:
        return f"wds{self.slot}-{who}"

    def link(self, who: str) -> str:
        return f"wds{self.slot}{who[0]}{who[1:] if who.startswith('n') else ''}"  # wds7h, wds7s, wds7n0

    def addr(self, who: str) -> str:
        host = {"head": 1, "store": 2}.get(who) or 10 + int(who[1:])
        return f"{self._net()}.{host}"

    @property
    def members(self) -> list[str]:
        return ["head", "store", *(f"n{i}" for i in range(self.nodes))]

    @property
    def rendezvous(self) -> str:
        return f"{self.addr('head')}:{RDZV_PORT}"

    @property
    def store_url(self) -> str:
        return f"http://{self.addr('store')}:{HTTP_PORT}"

    # ---- set-up and tear-down

    def __enter__(self) -> Cluster:
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self._take_slot()
        try:
            self._build()
            self.spawn(
                "head", "rendezvous", [sys.executable, "-m", "tests.helpers.cluster", "rendezvous", self.addr("head")]
            )
            if self.serve is not None:
                self.spawn(
                    "store",
                    "store",
                    [sys.executable, "-m", "tests.helpers.cluster", "serve", self.addr("store"), str(self.serve)],
                )
            self.wait_listening("head", RDZV_PORT)
            if self.serve is not None:
                self.wait_listening("store", HTTP_PORT)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            kill_tree(proc.pid)
            proc.wait()
        self._teardown()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _take_slot(self) -> None:
        """The first free slot (a lock file held for the cluster's life); what a dead holder of
        that slot left behind is removed first."""
        LOCKS.mkdir(parents=True, exist_ok=True)
        start = os.getpid() % SLOTS
        for i in range(SLOTS):
            slot = (start + i) % SLOTS
            f = open(LOCKS / f"{slot}.lock", "w")  # noqa: SIM115 (held until __exit__)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self.slot, self._lock = slot, f
            self._teardown()
            return
        raise RuntimeError(f"no free cluster slot in {LOCKS}")

    def _build(self) -> None:
        bridge = f"wdsb{self.slot}"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for who in self.members:
            ns, host_end = self.ns(who), self.link(who)
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", f"{host_end}p", "netns", ns)
            _ip("-n", ns, "link", "set", f"{host_end}p", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr(who)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", host_end, "master", bridge, "up")

    def _teardown(self) -> None:
        """Remove this slot's namespaces and links (those of a dead holder too); never fails."""
        prefix = f"wds{self.slot}-"
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(prefix):
                _ip("netns", "delete", name, check=False)
        _ip("link", "delete", f"wdsb{self.slot}", check=False)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(f"wds{self.slot}") and name[len(f"wds{self.slot}") :][:1] in ("h", "s", "n"):
                _ip("link", "delete", name, check=False)

    # ---- processes

    def spawn(self, who: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """``argv`` in ``who``'s namespace, its output in logs/NAME.log."""
        log = open(self.work / "logs" / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0", **(env or {})}
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(who), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=full_env,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.work / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_listening(self, who: str, port: int, timeout: float = 60.0) -> None:
        """Until something in ``who``'s namespace listens on ``port`` (ss, no connection made)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["ip", "netns", "exec", self.ns(who), "ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True
            ).stdout
            if out.strip():
                return
            time.sleep(0.1)
        raise TimeoutError(f"nothing listens on {who}:{port} after {timeout:g}s")

    def agent(
        self,
        node: int,
        script_args: list[str],
        *,
        nnodes: str = "1:2",
        nproc: int = 1,
        max_restarts: int = 3,
        env: dict[str, str] | None = None,
        rdzv_conf: str = FAST_RDZV,
    ) -> subprocess.Popen:
        """Node ``node``'s torchrun agent (``nproc`` ranks) running train.py with ``script_args``."""
        who = f"n{node}"
        argv = [
            *(sys.executable, "-m", "wdsdist.cluster.launch"),  # ./run torchrun's launcher
            f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={self.rendezvous}",
            "--rdzv_id=chaos",
            f"--rdzv_conf=is_host=false,{rdzv_conf}",
            f"--local-addr={self.addr(who)}",
            "--monitor-interval=0.5",
            "train.py",
            *script_args,
        ]
        return self.spawn(who, f"agent-{node}", argv, {"OMP_NUM_THREADS": "1", **(env or {})})

    def lose(self, name: str) -> None:
        """Every process of ``name``'s tree killed at once: a node losing power."""
        kill_tree(self.procs[name].pid)

    # ---- the network

    def cut(self, who: str) -> None:
        """``who``'s link down: its packets go nowhere, and nothing tells its peers."""
        _ip("link", "set", self.link(who), "down")

    def heal(self, who: str) -> None:
        _ip("link", "set", self.link(who), "up")

    def delay(self, seconds: float, port: int = DELAY_PORT, target: int = HTTP_PORT) -> str:
        """A relay on ``port`` in the store's namespace that adds ``seconds`` each way to what
        the store serves on ``target`` (its HTTP, or another server there such as an S3 API): a
        far store's latency. The URL to reach ``target`` through it; one relay per ``port``."""
        me = [sys.executable, "-m", "tests.helpers.cluster"]
        to = [self.addr("store"), str(target)]
        self.spawn("store", f"delay-{port}", [*me, "delay", self.addr("store"), str(port), *to, str(seconds)])
        self.wait_listening("store", port)
        return f"http://{self.addr('store')}:{port}"

    def shape(self, who: str, rate: str) -> None:
        """What ``who`` sends is limited to ``rate`` (tc tbf, e.g. "24mbit")."""
        subprocess.run(
            ["ip", "netns", "exec", self.ns(who), "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
             "rate", rate, "burst", "32kb", "latency", "400ms"],
            check=True, capture_output=True,
        )  # fmt: skip


def clean() -> list[int]:
    """Remove what clusters whose process died without tearing down (a killed pytest) left:
    every slot with namespaces or links whose lock nobody holds. The slots cleaned."""
    names = _ip("netns", "list", check=False).stdout.split() + [
        line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show", check=False).stdout.splitlines()
    ]
    slots = sorted({int(m.group(1)) for n in names if (m := re.fullmatch(r"wdsb?(\d+)(?:-\w+|[hsn]\d*)?", n))})
    cleaned = []
    for slot in slots:
        c = Cluster(0, Path("/nonexistent"))
        LOCKS.mkdir(parents=True, exist_ok=True)
        with open(LOCKS / f"{slot}.lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live cluster
            c.slot = slot
            c._teardown()
            cleaned.append(slot)
    return cleaned


# ---- the head's and the store's services, run as `python -m tests.helpers.cluster ...`


def _rendezvous(host: str) -> None:
    """A standalone c10d TCPStore for torchrun's c10d rendezvous (agents use it with is_host=false)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(host, RDZV_PORT, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    print(f"rendezvous store on {host}:{RDZV_PORT}", flush=True)
    while store is not None:  # until killed
        time.sleep(3600)


def delay_proxy(host: str, port: int, target: tuple[str, int], delay_s: float, ready=None) -> None:
    """Relay TCP connections on host:port to ``target``, each chunk ``delay_s`` late in either
    direction: the latency of a far store, which this kernel's missing netem cannot add. Chunks
    keep their order; a connection's end is passed on once its data has been."""
    import asyncio

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def late() -> None:
            while (item := await queue.get()) is not None:
                due, chunk = item
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(chunk)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(late())
        try:
            while chunk := await reader.read(1 << 16):
                queue.put_nowait((loop.time() + delay_s, chunk))
        except ConnectionError:
            pass
        queue.put_nowait(None)
        await sender

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    async def main() -> None:
        server = await asyncio.start_server(handle, host, port)
        if ready is not None:
            ready(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _serve(host: str, folder: str) -> None:
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=folder)
    with http.server.ThreadingHTTPServer((host, HTTP_PORT), handler) as server:
        print(f"serving {folder} on {host}:{HTTP_PORT}", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "rendezvous":
        _rendezvous(sys.argv[2])
    elif sys.argv[1] == "serve":
        _serve(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "delay":  # HOST PORT TARGET_HOST TARGET_PORT SECONDS
        delay_proxy(sys.argv[2], int(sys.argv[3]), (sys.argv[4], int(sys.argv[5])), float(sys.argv[6]))
    elif sys.argv[1] == "clean":
        print(f"cleaned slots {clean() or 'none'}")
