"""./run's environments: built beside the one in use and swapped in under a lock, never deleted
under a running process. The real script runs in a copy of the repository in a temporary folder
(never this checkout's .venv), with a requirements.txt and a requirements-dev.txt that name no
package: its environments are made with ``venv --without-pip``, offline, in well under a second."""

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
# ./run's environment is made from both files; requirements-dev.txt includes requirements.txt.
REQUIREMENTS = ("requirements.txt", "requirements-dev.txt")

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="./run needs util-linux's flock to lock")


@pytest.fixture
def repo(tmp_path):
    """A copy of ./run with requirements files that name nothing, and a python3.11 on PATH that,
    when it makes a venv, says so on stderr and waits for a line on stdin if WAIT_FOR_GO is set.
    With FAKE_PIP_LOG set it makes the venv without pip and puts in a bin/python that logs its
    ``-m pip`` calls to that file instead of installing (and runs anything else)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy2(ROOT / "run", repo / "run")
    (repo / "requirements.txt").write_text("# nothing\n")
    (repo / "requirements-dev.txt").write_text("-r requirements.txt\n# nothing more\n")
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
        '  if [ -n "$FAKE_PIP_LOG" ]; then\n'
        "    for env_dir; do :; done\n"  # the last argument
        f'    {base} -m venv --without-pip "$env_dir" || exit 1\n'
        '    rm -f "$env_dir/bin/python"\n'  # a link to the base python: not to be written through
        "    cat > \"$env_dir/bin/python\" <<'EOF'\n"
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >> "$FAKE_PIP_LOG"; exit 0; fi\n'
        'exec "$(dirname "$0")/python3" "$@"\n'
        "EOF\n"
        '    chmod +x "$env_dir/bin/python"; exit 0\n'
        "  fi\n"
        "fi\n"
        f'exec {base} "$@"\n'
    )
    wrapper.chmod(0o755)
    return repo


def env(repo: Path, **extra: str) -> dict:
    path = f"{repo.parent / 'bin'}:{os.environ['PATH']}"
    clean = {k: v for k, v in os.environ.items() if k not in ("WDSDIST_SYSTEM_PYTHON", "VIRTUAL_ENV")}
    return dict(clean, PATH=path, **extra)


def run(repo: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env_vars = env(repo, **extra)
    return subprocess.run(["./run", *args], cwd=repo, env=env_vars, capture_output=True, text=True, timeout=120)


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


def marker(repo: Path) -> str:
    """What ./run writes last into a complete environment: sha256sum's lines for both files."""
    return "".join(f"{hashlib.sha256((repo / name).read_bytes()).hexdigest()}  {name}\n" for name in REQUIREMENTS)


def env_dir(repo: Path) -> Path:
    return repo / f".venv-{hashlib.sha256(marker(repo).encode()).hexdigest()[:12]}"


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
    sums = subprocess.run(["sha256sum", *REQUIREMENTS], cwd=repo, capture_output=True, text=True, check=True)
    assert sums.stdout == marker(repo)
    (repo / ".venv" / ".requirements.sha256").write_text(sums.stdout)
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


@pytest.mark.parametrize("changed", REQUIREMENTS)
def test_a_change_to_either_requirements_file_makes_a_new_environment(repo, changed):
    assert run(repo, "show.py").returncode == 0
    old = env_dir(repo)
    assert (old / ".requirements.sha256").read_text() == marker(repo)
    with open(repo / changed, "a") as f:
        f.write("# changed\n")
    new = env_dir(repo)
    assert new != old
    proc = run(repo, "show.py")
    assert proc.returncode == 0 and proc.stdout.strip() == str(new), proc.stderr
    assert f"making {new.name}" in proc.stderr and f"removed {old.name}, no longer used" in proc.stderr
    assert (new / ".requirements.sha256").read_text() == marker(repo)


def test_a_marker_for_requirements_txt_alone_does_not_fit(repo):
    # An environment made before requirements-dev.txt existed has no test tools: it is replaced.
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True)
    sums = subprocess.run(["sha256sum", "requirements.txt"], cwd=repo, capture_output=True, text=True, check=True)
    (repo / ".venv" / ".requirements.sha256").write_text(sums.stdout)
    proc = run(repo, "show.py")
    assert proc.returncode == 0 and proc.stdout.strip() == str(env_dir(repo)), proc.stderr
    assert f"making {env_dir(repo).name}" in proc.stderr
    assert os.readlink(repo / ".venv") == env_dir(repo).name


def test_the_environment_is_installed_from_requirements_dev_txt(repo, tmp_path):
    # A package named in either file means pip runs, once, on requirements-dev.txt (which
    # includes requirements.txt); the fake python logs the calls instead of installing.
    (repo / "requirements.txt").write_text("somepackage==1.0\n")
    log = tmp_path / "pip.log"
    proc = run(repo, "show.py", FAKE_PIP_LOG=str(log))
    assert proc.returncode == 0 and proc.stdout.strip() == str(env_dir(repo)), proc.stderr
    installs = [line.split() for line in log.read_text().splitlines() if "--upgrade" not in line]
    assert len(installs) == 1 and installs[0][-2:] == ["-r", "requirements-dev.txt"], log.read_text()


def test_a_missing_requirements_dev_txt_is_named(repo):
    (repo / "requirements-dev.txt").unlink()
    proc = run(repo, "show.py")
    assert proc.returncode == 2 and "no requirements-dev.txt" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not list(repo.glob(".venv-*"))


def test_help_names_every_command_and_script_and_ends_whole():
    proc = subprocess.run([str(ROOT / "run"), "help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for name in (
        "train.py",
        "makeshards.py",
        "simdist.py",
        "examples/ddp_loop.py",
        "lightning_train.py",
        "test",
        "fuzz",
    ):
        assert name in text, name
    commands = {line.split()[1] for line in text.splitlines() if line.strip().startswith("./run ")}
    cases = subprocess.run(["grep", "-oE", r"^  [a-z|-]+\)", str(ROOT / "run")], capture_output=True, text=True).stdout
    for case in cases.split():
        for word in case.strip(")").split("|"):
            assert word in commands or word in ("-h", "--help"), f"./run {word} is not in ./run help"
    assert text.rstrip().endswith(")."), text[-200:]  # a whole last sentence
