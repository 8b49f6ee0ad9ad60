"""The trainer's processes at scale: the per-step agreement on stop flags, start-up and step rate
against the world size, a forked child's exit (./run agree.py, worldsize.py, childexit.py)."""
