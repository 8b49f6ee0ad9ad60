"""Faults in a training job's checkpoints on disk (the rest of its faults: tests/train/test_faults_train.py):
a crash mid-save leaves the previous checkpoint whole, a corrupt latest one falls back to the one
before, pruning never loses latest.pt's file, a start cut off from a later one writes nothing (no
split brain), a run directory holds one run, and a pickled payload never runs. Most save real
checkpoints of a tiny model in-process (wdsdist.train.checkpoint); two run train.py with the fault
tests' tiny configuration (tests/helpers/training.py's FAST)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import one_error_line, run_script
from tests.helpers.training import FAST, train
from tests.helpers.training import fast_args as args
from tests.helpers.training import shards as shards  # noqa: F401  (the module's fixture, reused)

pytestmark = pytest.mark.slow  # real training processes


class FakeLoader:
    def state_dict(self) -> dict:
        return {"point": {"epoch": 0, "workers": {}}, "batches": 0, "workers": 1, "rank": 0, "world": 1}


def save(run_dir: Path, step: int, keep: int = 3, generation: int = 1) -> str:
    import torch
    from omegaconf import OmegaConf

    from wdsdist.cluster.distributed import Dist
    from wdsdist.train.checkpoint import Generation, save_checkpoint

    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = OmegaConf.create({"trainer": {"workers": 1}})
    d = Dist(0, 1, 0, torch.device("cpu"))
    return save_checkpoint(str(run_dir), step, d, model, opt, FakeLoader(), cfg, keep, Generation(generation, False))


def test_a_start_cut_off_from_a_later_one_writes_no_checkpoint(tmp_path, monkeypatch):
    """No split brain: once a later start of the job (torchrun re-forming it without a cut-off
    node) has begun in the run directory, the earlier start's rank 0 writes nothing more, neither
    when it checks before writing nor when the later start begins while it writes."""
    import torch

    from wdsdist.errors import JobError
    from wdsdist.train.checkpoint import begin_generation, checkpoints, same_job

    first = begin_generation(str(tmp_path), "job-a", restarted=False)
    save(tmp_path, 2, generation=first.number)
    second = begin_generation(str(tmp_path), "job-a", restarted=True)
    assert (first.number, second.number) == (1, 2) and same_job(str(tmp_path), "job-a")
    assert not same_job(str(tmp_path), "job-b") and not same_job(str(tmp_path), None)
    save(tmp_path, 4, generation=second.number)
    with pytest.raises(JobError) as refused:
        save(tmp_path, 6, generation=first.number)
    assert str(refused.value) == (
        f"a later start of this job (generation 2) owns {tmp_path}: this one (generation 1) was cut off from it and "
        "stops without writing"
    )
    real_save = torch.save

    def save_while_a_third_start_begins(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        begin_generation(str(tmp_path), "job-a", restarted=True)

    with monkeypatch.context() as m:
        m.setattr(torch, "save", save_while_a_third_start_begins)
        with pytest.raises(JobError):
            save(tmp_path, 8, generation=second.number)
    assert [os.path.basename(p) for p in checkpoints(str(tmp_path))] == ["ckpt-0000002.pt", "ckpt-0000004.pt"]
    assert os.readlink(tmp_path / "latest.pt") == "ckpt-0000004.pt"  # never moved back, never to a refused one
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_crash_mid_save_leaves_the_previous_checkpoint_whole_and_no_tmp_is_read(tmp_path, monkeypatch):
    import torch

    from wdsdist.train.checkpoint import checkpoints, find_resume, load_checkpoint, remove_stale_tmp

    save(tmp_path, 2)

    def torn_save(obj, f, *a, **kw):  # the disk fills up half way through
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", torn_save)
        with pytest.raises(OSError, match="No space left"):
            save(tmp_path, 4)
    assert os.readlink(tmp_path / "latest.pt") == "ckpt-0000002.pt"
    assert load_checkpoint(str(tmp_path / "latest.pt"))["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000002.pt", "latest.pt"]  # no .tmp left

    # What a writer killed with SIGKILL leaves (its .tmp files) is never taken for a checkpoint,
    # and the next start removes it.
    (tmp_path / "ckpt-0000004.pt.tmp4242").write_bytes(b"torn")
    (tmp_path / ".latest.pt.tmp4242").symlink_to("ckpt-0000004.pt.tmp4242")
    assert [Path(p).name for p in checkpoints(str(tmp_path))] == ["ckpt-0000002.pt"]
    assert find_resume("auto", str(tmp_path)) == [str(tmp_path / "latest.pt")]
    assert len(remove_stale_tmp(str(tmp_path))) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000002.pt", "latest.pt"]


def test_a_corrupt_latest_checkpoint_falls_back_to_the_one_before(tmp_path, capsys):
    from wdsdist.errors import UserError
    from wdsdist.train.checkpoint import find_resume, load_first

    for step in (2, 4, 6):
        save(tmp_path, step)
    data = (tmp_path / "ckpt-0000006.pt").read_bytes()
    (tmp_path / "latest.pt").write_bytes(data[: len(data) // 2])  # through the link: ckpt-0000006.pt
    path, ckpt, warnings = load_first(find_resume("auto", str(tmp_path)))
    assert path == str(tmp_path / "ckpt-0000004.pt") and ckpt["step"] == 4
    assert len(warnings) == 1 and f"cannot load {tmp_path / 'latest.pt'}" in warnings[0]
    assert "(latest.pt -> ckpt-0000006.pt); trying the checkpoint before it" in warnings[0]
    assert warnings[0] in capsys.readouterr().err

    (tmp_path / "ckpt-0000004.pt").write_bytes(os.urandom(1000))
    path, ckpt, warnings = load_first(find_resume(str(tmp_path), "elsewhere"))
    assert ckpt["step"] == 2 and len(warnings) == 2
    # A file named on purpose is that file or an error, never another one.
    with pytest.raises(UserError, match="cannot load .*ckpt-0000004.pt"):
        load_first(find_resume(str(tmp_path / "ckpt-0000004.pt"), "elsewhere"))
    (tmp_path / "ckpt-0000002.pt").write_bytes(b"")
    with pytest.raises(UserError, match="none of 3 checkpoints loads; the newest: cannot load .*latest.pt"):
        load_first(find_resume("auto", str(tmp_path)))


def test_train_resumes_past_a_corrupt_latest_checkpoint(shards, tmp_path):
    run = tmp_path / "run"
    train(shards, run, *FAST, "trainer.steps=2", "trainer.ckpt_every=1")
    (run / "latest.pt").write_bytes(b"\0" * 100)  # ckpt-0000002.pt, through the link
    summary = train(shards, run, *FAST, "trainer.steps=2", "trainer.resume=auto")
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 2
    log = (run / "train.log").read_text()
    assert f"warning: cannot load {run / 'latest.pt'}: " in log and "(latest.pt -> ckpt-0000002.pt)" in log
    assert f"resumed from {run / 'ckpt-0000001.pt'} at step 1" in log


def test_pruning_never_deletes_the_checkpoint_just_written_and_latest_names_a_file(tmp_path):
    # Step numbers alone would keep ckpt-4 and delete ckpt-2 at once: latest.pt would dangle and a
    # later resume=auto would continue the other trajectory's step 4.
    save(tmp_path, 4, keep=1)
    save(tmp_path, 2, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000002.pt", "latest.pt"]
    assert os.readlink(tmp_path / "latest.pt") == "ckpt-0000002.pt"
    # A resume from an older checkpoint: the abandoned later steps are pruned before this run's own.
    for step in (4, 6):
        save(tmp_path, step, keep=3)
    save(tmp_path, 3, keep=3)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000002.pt", "ckpt-0000003.pt", "ckpt-0000006.pt"]
    assert os.readlink(tmp_path / "latest.pt") == "ckpt-0000003.pt"
    save(tmp_path, 4, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000003.pt", "ckpt-0000004.pt", "latest.pt"]
    assert (tmp_path / "latest.pt").resolve() == tmp_path / "ckpt-0000004.pt"


def test_a_new_run_in_a_directory_with_another_runs_checkpoints_is_refused_unless_it_resumes(shards, tmp_path):
    run = tmp_path / "run"
    train(shards, run, *FAST, "trainer.steps=4", "trainer.keep=1")
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    proc = run_script("train.py", *args(shards, run, "trainer.steps=2"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line == (
        f"error: run directory {run} already holds another run's checkpoints (newest: ckpt-0000004.pt, step 4): "
        f"set trainer.resume=auto to continue that run, or give this one its own run_dir (under torchrun: its own "
        f"--rdzv_id)"
    )
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # not a byte of it changed
    summary = train(shards, run, *FAST, "trainer.steps=6", "trainer.keep=1", "trainer.resume=auto")
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6
    assert sorted(p.name for p in run.glob("*.pt")) == ["ckpt-0000006.pt", "latest.pt"]


class Payload:
    """Unpickling this runs code: what a hostile checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_checkpoints_load_weights_only_so_a_pickled_payload_never_runs(tmp_path):
    import torch

    from wdsdist.errors import UserError
    from wdsdist.train.checkpoint import CKPT_FORMAT, load_checkpoint

    marker = tmp_path / "payload-ran"
    torch.save({"format": CKPT_FORMAT, "step": 1, "extra": Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(UserError, match=r"trainer.resume: cannot load .*evil.pt: Weights only load failed"):
        load_checkpoint(str(tmp_path / "evil.pt"))
    assert not marker.exists()
