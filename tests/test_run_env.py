"""./run's environments: built beside the one in use and swapped in under a lock, never deleted
under a running process. The real script runs in a copy of the repository in a temporary folder
(never this checkout's .venv), with a requirements.txt that names no package: its environments
are made with ``venv --without-pip``, offline, in well under a second."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SHOW = "import sys\nprint(sys.prefix, flush=True)\n"
# Holds its environment until told to go on, then checks its files are still all there.
HOLD = SHOW + "sys.stdin.readline()\nimport os\nprint(os.path.isfile(os.path.join(sys.prefix, 'pyvenv.cfg')))\n"

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="./run needs util-linux's flock to lock")


@pytest.fixture
def repo(tmp_path):
    """A copy of ./run with an empty requirements.txt, and a python3.11 on PATH that, when it
    makes a venv, says so on stderr and waits for a line on stdin if WAIT_FOR_GO is set."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy2(ROOT / "run", repo / "run")
    (repo / "requirements.txt").write_text("# nothing\n")
    (repo / "show.py").write_text(SHOW)
    (repo / "hold.py").write_text(HOLD)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    base = getattr(sys, "_base_executable", sys.executable)
    wrapper = bin_dir / "python3.11"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        '  echo "venv build started" >&2\n'
        '  if [ -n "$WAIT_FOR_GO" ]; then read go; fi\n'
        "fi\n"
        f'exec {base} "$@"\n'
    )
    wrapper.chmod(0o755)
    return repo


def env(repo: Path, **extra: str) -> dict:
    path = f"{repo.parent / 'bin'}:{os.environ['PATH']}"
    clean = {k: v for k, v in os.environ.items() if k not in ("WDSDIST_SYSTEM_PYTHON", "VIRTUAL_ENV")}
    return dict(clean, PATH=path, **extra)


def run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["./run", *args], cwd=repo, env=env(repo), capture_output=True, text=True, timeout=120)


def start(repo: Path, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["./run", *args],
        cwd=repo,
        env=env(repo, **extra),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def env_dir(repo: Path) -> Path:
    return repo / f".venv-{hashlib.sha256((repo / 'requirements.txt').read_bytes()).hexdigest()[:12]}"


def read_until(stream, text: str) -> list[str]:
    """Lines of ``stream`` up to the one containing ``text``; fails at the end of the stream."""
    lines = []
    while line := stream.readline():
        lines.append(line)
        if text in line:
            return lines
    pytest.fail(f"no {text!r} in:\n{''.join(lines)}")


def test_two_concurrent_runs_build_the_environment_once(repo):
    first = start(repo, "show.py", WAIT_FOR_GO="1")
    try:
        read_until(first.stderr, "venv build started")  # the first one builds, holding the lock
        second = start(repo, "show.py")
        try:
            read_until(second.stderr, "waiting for another ./run that holds")  # it waits, not builds
            out1, err1 = first.communicate("go\n", timeout=120)
            out2, err2 = second.communicate(timeout=120)
        finally:
            second.kill()
    finally:
        first.kill()
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert "making" not in err2 and "venv build started" not in err2
    want = env_dir(repo)
    assert out1.strip() == out2.strip() == str(want)
    assert os.readlink(repo / ".venv") == want.name
    assert sorted(p.name for p in repo.glob(".venv*")) == [".venv", want.name, ".venv.lock"]


@pytest.mark.parametrize("how", ["./run", "direct"])
def test_a_running_process_keeps_its_environment_until_it_ends(repo, how):
    # Through ./run it holds the environment's lock; started directly, its command line names it.
    assert run(repo, "show.py").returncode == 0
    old = env_dir(repo)
    if how == "./run":
        holder = start(repo, "hold.py")
    else:
        holder = subprocess.Popen(
            [str(old / "bin" / "python"), "hold.py"], cwd=repo, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
    try:
        assert holder.stdout.readline().strip() == str(old)
        (repo / "requirements.txt").write_text("# something else\n")
        new = env_dir(repo)
        proc = run(repo, "show.py")  # builds the new one and points .venv at it
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(new) and os.readlink(repo / ".venv") == new.name
        assert (old / "pyvenv.cfg").is_file()  # in use: kept
        out, err = holder.communicate("go\n", timeout=120)
    finally:
        holder.kill()
    assert holder.returncode == 0 and out.strip() == "True", err
    proc = run(repo, "show.py")  # nobody uses the old one now
    assert proc.returncode == 0 and f"removed {old.name}, no longer used" in proc.stderr
    assert not old.exists() and proc.stdout.strip() == str(new)
    assert "making" not in proc.stderr


def test_an_older_checkouts_real_venv_is_used_while_it_fits_then_replaced_once_unused(repo):
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True)
    marker = subprocess.run(["sha256sum", "requirements.txt"], cwd=repo, capture_output=True, text=True, check=True)
    (repo / ".venv" / ".requirements.sha256").write_text(marker.stdout)
    proc = run(repo, "show.py")
    assert proc.returncode == 0 and proc.stdout.strip() == str(repo / ".venv") and "making" not in proc.stderr
    holder = start(repo, "hold.py")
    try:
        assert holder.stdout.readline().strip() == str(repo / ".venv")
        (repo / "requirements.txt").write_text("# something else\n")
        proc = run(repo, "show.py")  # the old directory is in use: left where it is
        assert proc.returncode == 0 and proc.stdout.strip() == str(env_dir(repo)), proc.stderr
        assert "is in use by a ./run process" in proc.stderr
        assert (repo / ".venv").is_dir() and not (repo / ".venv").is_symlink()
        out, err = holder.communicate("go\n", timeout=120)
    finally:
        holder.kill()
    assert holder.returncode == 0 and out.strip() == "True", err
    proc = run(repo, "show.py")
    assert proc.returncode == 0 and proc.stdout.strip() == str(env_dir(repo)), proc.stderr
    assert os.readlink(repo / ".venv") == env_dir(repo).name
    assert sorted(p.name for p in repo.glob(".venv*")) == [".venv", env_dir(repo).name, ".venv.lock"]


def test_a_checkout_reached_through_a_link_keeps_the_environment_it_runs(repo):
    # The link's path and the environments' real paths must not be taken for two checkouts: the
    # environment about to run would look unused, and be removed.
    link = repo.parent / "link"
    link.symlink_to(repo)
    for _ in range(2):  # PWD as a shell that did `cd link` passes it on
        proc = subprocess.run(
            ["./run", "show.py"], cwd=link, env=env(repo, PWD=str(link)), capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and proc.stdout.strip() == str(env_dir(repo)), proc.stderr
        assert "removed" not in proc.stderr
