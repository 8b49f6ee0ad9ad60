"""``./run torchrun`` (``python -m wdsdist.cluster.launch``): torchrun itself, with two changes.

- A rendezvous that fails is one line, not torch's traceback: the rendezvous host lost or never
  reachable, or a join that timed out, is the operator's to fix, and they need the endpoint and
  what happens next. Any other failure keeps torchrun's own report.
- One store per rendezvous round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless set): with
  torch 2.14's default, the agents' store shared with the workers, a node joining a running job
  waits for good on an address the round's rank 0 never publishes, and so does a new rank 0
  among three or more nodes once the old one's node is lost. With a store per round, hosted by
  the round's rank 0, neither happens (docs/reliability.md: Faults at cluster shape).
"""

from __future__ import annotations

import os
import sys

WHAT = {
    "RendezvousConnectionError": "does not answer",
    "RendezvousTimeoutError": "did not gather the nodes in time (--rdzv_conf join_timeout)",
    "RendezvousClosedError": "was closed (the job ended on another node)",
}


def endpoint(argv: list[str]) -> str:
    """The --rdzv_endpoint (or --rdzv-endpoint) of a torchrun command line; "" when not given."""
    for i, arg in enumerate(argv):
        for name in ("--rdzv_endpoint", "--rdzv-endpoint"):
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return ""


def rendezvous_line(exc: BaseException, argv: list[str]) -> str:
    """The one line for a failed rendezvous."""
    where = endpoint(argv)
    what = WHAT.get(type(exc).__name__, f"failed ({type(exc).__name__})")
    cause = exc.__cause__ or exc.__context__
    why = f" ({str(cause).splitlines()[0]})" if cause is not None and str(cause).strip() else ""
    return (
        f"error: torchrun: the rendezvous{' at ' + where if where else ''} {what}{why}; this node stops (ranks it "
        f"ran were sent SIGTERM: each writes a checkpoint first where it can); start the job again once the "
        f"rendezvous answers (trainer.resume=auto continues it)"
    )


def main() -> int:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    sys.argv[0] = "torchrun"  # its usage and errors name the command people know
    try:
        torchrun()
    except RendezvousError as exc:
        print(rendezvous_line(exc, sys.argv[1:]), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
