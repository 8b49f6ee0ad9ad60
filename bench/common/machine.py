"""What a benchmark report names the machine by (shared by the bench scripts)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
