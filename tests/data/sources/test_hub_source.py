"""hf:// shards from a Hugging Face Hub (the fake one of tests/helpers/hub.py, at HF_ENDPOINT): the
Loader and the trainer read them with exact epochs and equal batches, at one commit pinned when
the run begins (also across a kill -9 and a resume after the branch moved), with sample counts
from the data set's _info.json and no shard read for them; a node cache fetches each shard once
over three epochs; an expired signed URL is resolved again; every error is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, one_error_line, run_script, write_tiny_shards
from tests.helpers.hub import Hub
from tests.helpers.loading import cfg
from tests.helpers.trace import delivery, kept
from tests.helpers.training import free_port, overrides, ranks
from wdsdist.data import Loader
from wdsdist.data.sources import opener, shardspec
from wdsdist.data.sources.access import Access
from wdsdist.errors import UserError

TRAIN, VAL = [5, 7, 6, 4], [6, 6]
REPO, GATED = "org/tiny", "org/gated"
SPEC = f"hf://datasets/{REPO}/train-{{000000..000003}}.tar"
VAL_SPEC = f"hf://datasets/{REPO}/val-{{000000..000001}}.tar"


def files_of(tmp_path: Path, info: bool = True) -> dict[str, bytes | Path]:
    """The data set: train and validation shards, and timm's _info.json with their counts."""
    files: dict[str, bytes | Path] = {}
    splits = {}
    for split, counts in (("train", TRAIN), ("val", VAL)):
        write_tiny_shards(tmp_path / "made" / split, counts, split, size=32)
        names = sorted(p.name for p in (tmp_path / "made" / split).glob("*.tar"))
        files |= {n: tmp_path / "made" / split / n for n in names}
        splits[split] = {"name": split, "num_samples": sum(counts), "filenames": names, "shard_lengths": counts}
    if info:
        files["_info.json"] = json.dumps({"name": "tiny", "splits": splits}).encode()
    return files


def tar_counts(counter) -> dict[str, int]:
    return {k: v for k, v in counter.items() if k.endswith(".tar")}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with Hub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file of this machine's
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        h.commits = {REPO: h.add_repo(REPO, files_of(tmp_path))}
        yield h


def hub_env(hub: Hub, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


# ---------------------------------------------------------------- the Loader


def test_the_spec_is_pinned_and_counted_from_the_info_file_with_no_shard_read(hub):
    shards = shardspec.expand(SPEC)
    commit = hub.commits[REPO]
    assert [s.url for s in shards] == [f"hf://datasets/{REPO}@{commit}/train-{i:06d}.tar" for i in range(4)]
    assert [s.nsamples for s in shards] == TRAIN
    assert tar_counts(hub.cdn_requests) == {}  # counts without reading a shard
    # A glob lists the data set; a pinned spec names its commit and reads nothing else.
    assert shardspec.expand(f"hf://datasets/{REPO}/train-*.tar") == shards
    assert shardspec.expand(f"hf://datasets/{REPO}@{commit}/train-*.tar") == shards


def test_two_ranks_read_every_sample_once_in_equal_batches(hub):
    delivered = []
    for rank in (0, 1):
        loader = Loader(SPEC, cfg(workers=1, split="samples"), rank=rank, world=2)
        batches = [b["key"] for b in loader]
        delivered.append(batches)
    assert len(delivered[0]) == len(delivered[1]) > 0
    keys = [k for rank in delivered for batch in rank for k in batch]
    assert set(keys) == {f"s{i:07d}" for i in range(sum(TRAIN))}
    assert len(keys) - len(set(keys)) == len(keys) - sum(TRAIN) < 2 * 4  # only the padding, less than a batch each
    assert hub.cdn_authorization == []  # the token never leaves the Hub's own origin


def test_shards_named_at_a_branch_read_as_the_branch_is_now(hub):
    shards = [
        shardspec.Shard(f"hf://datasets/{REPO}/train-000000.tar", 5),
        shardspec.Shard(f"hf://datasets/{REPO}@main/train-000001.tar", 7),
    ]
    keys = [k for b in Loader(shards, cfg(batch_size=12, split="samples")) for k in b["key"]]
    assert sorted(keys) == [f"s{i:07d}" for i in range(12)]


def test_without_counts_split_samples_says_to_index_and_makeshards_indexes_resumably(hub, tmp_path):
    bare = hub.add_repo("org/bare", {k: v for k, v in files_of(tmp_path / "b", info=False).items()})
    spec = "hf://datasets/org/bare/train-{000000..000003}.tar"
    with pytest.raises(UserError, match=r"needs sample counts per shard .*\(makeshards.py --index\)"):
        Loader(spec, cfg(split="samples"))
    # A count stopped midway (here: a shard that cannot be read) goes on where it stopped.
    from wdsdist.tools import makeshards

    output = tmp_path / "bare.index.json"
    shards = shardspec.expand(spec)
    broken = [shards[0], shards[1], shardspec.Shard(shards[2].url.replace("train-000002", "gone")), shards[3]]
    with pytest.raises(UserError, match="gone"):
        makeshards.count_all(broken, str(output) + makeshards.PARTIAL)
    hub.reset_counts()
    made = run_script(
        "makeshards.py", "--index", f"hf://datasets/org/bare@{bare}/train-{{000000..000003}}.tar",
        "--output", str(output), env=hub_env(hub, tmp_path),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "2 of 4 shards counted before" in made.stderr and "indexed 4 shards, 22 samples" in made.stdout
    assert sorted(tar_counts(hub.cdn_requests)) == ["org/bare/train-000002.tar", "org/bare/train-000003.tar"]
    assert not Path(str(output) + makeshards.PARTIAL).exists()
    keys = [k for b in Loader(str(output), cfg(split="samples")) for k in b["key"]]
    assert set(keys) == {f"s{i:07d}" for i in range(22)} and len(keys) == 24  # two padding copies


def test_an_index_in_the_data_set_is_read_at_the_pinned_commit(hub, tmp_path):
    entries = [{"url": f"train-{i:06d}.tar", "nsamples": n} for i, n in enumerate(TRAIN)]
    index = json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": entries}).encode()
    commit = hub.commit(REPO, {"train.index.json": index})
    shards = shardspec.expand(f"hf://datasets/{REPO}/train.index.json")
    assert [s.url for s in shards] == [f"hf://datasets/{REPO}@{commit}/train-{i:06d}.tar" for i in range(4)]
    outside = json.dumps({"shardlist": [{"url": "hf://datasets/org/other@main/x.tar", "nsamples": 1}]}).encode()
    hub.commit(REPO, {"bad.index.json": outside})
    with pytest.raises(UserError, match=r"shardlist\[0\]: refused .*not in the index's own data set"):
        shardspec.expand(f"hf://datasets/{REPO}/bad.index.json")


def test_an_expired_signed_url_is_resolved_again_mid_read(hub, tmp_path):
    url = shardspec.expand(SPEC)[1].url
    hub.url_uses = 1  # each signed URL opens once
    hub.cut_after(3000)  # the first read is cut: the reader comes back with a Range request
    hub.reset_counts()
    with opener.open_shard(url, Access(http_retry_s=30)) as stream:
        data = stream.read()
    assert data == (tmp_path / "made" / "train" / "train-000001.tar").read_bytes()
    assert hub.resolves[f"{REPO}/train-000001.tar"] == 2 and hub.cdn_authorization == []


def test_a_rate_limit_is_waited_for_within_the_budget_then_named(hub):
    hub.rate_limit(1, retry_after=1)
    assert len(shardspec.expand(SPEC, access=Access(http_retry_s=30))) == 4
    assert hub.rate_limited == 1
    hub.rate_limit(1000, retry_after=60)
    with pytest.raises(UserError) as err:
        shardspec.expand(SPEC, access=Access(http_retry_s=5))
    assert "the Hub's rate limit (429) for org/tiny; gave up after 1 tries" in str(err.value)
    assert "data.http_retry_s=5" in str(err.value) and "\n" not in str(err.value)


def errors_cases(hub) -> list[tuple[str, str | None, str]]:
    page, gated = f"{hub.endpoint}/datasets/{GATED}", f"hf://datasets/{GATED}/train-000000.tar"
    return [
        (gated, None, f"no token was sent: set HF_TOKEN (.*); ask for access at {page}"),
        (gated, "hf_other", f"this token has no access to it: ask for access at {page}"),
        ("hf://datasets/org/nope/train-000000.tar", None, "no data set org/nope on http://127.0.0.1"),
        (f"hf://datasets/{REPO}@v9/train-000000.tar", None, "org/tiny has no revision 'v9'"),
        (f"hf://datasets/{REPO}/train-000009.tar", None, r"matches no file in hf://datasets/org/tiny@main \(commit"),
        ("hf://datasets/org", None, "an hf:// shard spec is hf://datasets/ORG/NAME"),
    ]  # fmt: skip


def test_every_hub_error_is_one_line(hub, tmp_path, monkeypatch):
    hub.add_repo(GATED, files_of(tmp_path / "g"), gated=True)
    hub.grant("hf_mine", GATED)
    for spec, token, line in errors_cases(hub):
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        else:
            monkeypatch.delenv("HF_TOKEN", raising=False)
        with pytest.raises(UserError, match=line) as err:
            shardspec.expand(spec)
        assert "\n" not in str(err.value), spec
    monkeypatch.setenv("HF_TOKEN", "hf_mine")
    assert len(shardspec.expand(f"hf://datasets/{GATED}/train-*.tar")) == 4
    assert hub.cdn_authorization == []


# ---------------------------------------------------------------- the trainer


@pytest.mark.slow  # a job of two ranks
def test_training_reads_the_hub_with_exact_epochs_and_a_node_cache_fetches_it_once(hub, tmp_path):
    extra = (
        "loader.mode=epoch", "trainer.epochs=3", f"loader.cache_dir={tmp_path / 'cache'}", "trainer.ckpt_every=0",
        "loader.split=samples", "trainer.workers=1",
    )  # fmt: skip
    run = tmp_path / "run"
    env = hub_env(hub, tmp_path, WDSDIST_TEST_TRACE=str(tmp_path / "trace"))
    proc = ranks(2, *overrides({"train": SPEC, "val": VAL_SPEC}, run, *extra), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    epochs = kept(tmp_path / "trace")
    assert sorted(epochs) == [0, 1, 2] and all(delivery(p, sum(TRAIN)).exact for p in epochs.values())
    sizes = {f"{REPO}/{p.name}": p.stat().st_size for p in (tmp_path / "made").glob("*/*.tar")}
    assert tar_counts(hub.cdn_bytes) == sizes  # each shard, train and val, sent once to the node
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_samples"] == sum(VAL)
    assert json.loads((run / "pins.json").read_text()) == {
        SPEC: SPEC.replace(REPO, f"{REPO}@{hub.commits[REPO]}"),
        VAL_SPEC: VAL_SPEC.replace(REPO, f"{REPO}@{hub.commits[REPO]}"),
    }


@pytest.mark.slow  # two training processes
def test_a_resume_after_kill_9_reads_the_commit_the_run_began_with(hub, tmp_path):
    run, hold = tmp_path / "run", tmp_path / "hold"
    args = overrides(
        {"train": SPEC, "val": VAL_SPEC}, run, "trainer.steps=8", "trainer.ckpt_every=2", "model.name=squeezenet1_1",
        "trainer.workers=1", "loader.split=samples",
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **hub_env(hub, tmp_path))
    env |= {"WDSDIST_TEST_HOLD": str(hold), "WDSDIST_TEST_HOLD_STEP": "5", "WDSDIST_TEST_TRACE": str(tmp_path / "t")}
    (tmp_path / "hold.g1").write_text("")
    first = subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        held = tmp_path / "hold.g1.rank-0"
        deadline = time.monotonic() + 120
        while not held.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the trainer's own signal, not a pause
        assert held.exists(), f"the job did not reach the hold before step 5 (rc {first.poll()})"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    # The branch moves on: the shards are gone from main. The resumed run reads the old commit.
    moved = hub.commit(REPO, {"README.md": b"moved"}, delete=[p for p in hub_files(tmp_path) if p.endswith(".tar")])
    hub.reset_counts()
    resumed = run_script("train.py", *args, "trainer.resume=auto", env=hub_env(hub, tmp_path, **{
        "WDSDIST_TEST_TRACE": str(tmp_path / "t")}))  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    old = hub.commits[REPO]
    assert f"has moved since this run began (now {SPEC.replace(REPO, f'{REPO}@{moved}')})" in resumed.stderr
    assert sum(tar_counts(hub.cdn_bytes).values()) > 0  # it read shards, which only the old commit has
    ckpt = torch.load(run / "ckpt-0000008.pt", map_location="cpu", weights_only=True)
    assert ckpt["pins"][SPEC] == SPEC.replace(REPO, f"{REPO}@{old}")
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 4


def hub_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "made").glob("*/*.tar"))


def test_a_gated_data_set_without_a_token_stops_the_trainer_in_one_line(hub, tmp_path):
    hub.add_repo(GATED, files_of(tmp_path / "g"), gated=True)
    spec = f"hf://datasets/{GATED}/train-*.tar"
    proc = run_script(
        "train.py", *overrides({"train": spec, "val": "null"}, tmp_path / "run"), env=hub_env(hub, tmp_path)
    )
    assert proc.returncode != 0
    line = one_error_line(proc)
    assert "data.train_shards" in line and "set HF_TOKEN" in line and f"{hub.endpoint}/datasets/{GATED}" in line


def test_the_imagenet_hf_experiment_reads_a_stand_in_of_timm_imagenet_with_counts_and_no_shard_read(
    hub, tmp_path, monkeypatch
):
    from tests.helpers import hubdata
    from tests.helpers.config import compose_config
    from wdsdist.train import config

    cfg = compose_config(["+experiment=imagenet_hf"])
    config.check(cfg)
    assert (cfg.loader.mode.value, cfg.loader.shard_order, cfg.trainer.epochs, cfg.model.name) == (
        "epoch", "node", 90, "resnet50",
    )  # fmt: skip
    hubdata.write(tmp_path / "imagenet", per_shard=1, size=8)
    hub.add_repo("timm/imagenet-1k-wds", tmp_path / "imagenet", gated=True)
    hub.grant("hf_mine", "timm/imagenet-1k-wds")
    monkeypatch.setenv("HF_TOKEN", "hf_mine")
    train = shardspec.expand(cfg.data.train_shards)
    val = shardspec.expand(cfg.data.val_shards)
    assert (len(train), len(val), {s.nsamples for s in train + val}) == (1024, 64, {1})
    assert train[-1].url.endswith("/imagenet1k-train-1023.tar") and "@" in train[-1].url
    assert tar_counts(hub.cdn_requests) == {}


def test_a_resume_keeps_its_pin_when_the_hub_cannot_be_asked(hub, monkeypatch, caplog):
    from wdsdist.data import LoaderConfig
    from wdsdist.train import pins

    pinned = SPEC.replace(REPO, f"{REPO}@{hub.commits[REPO]}")
    config = LoaderConfig(batch_size=4, http_retry_s=0)
    assert pins._pin_one("data.train_shards", SPEC, None, config) == pinned
    hub.stop()  # the Hub is gone: a resume reads what it began with, a new run cannot start
    assert pins._pin_one("data.train_shards", SPEC, pinned, config) == pinned
    assert f"data.train_shards: {SPEC}: {hub.endpoint} did not answer" in caplog.text
    with pytest.raises(UserError, match=f"^data.train_shards: {SPEC}: {hub.endpoint} did not answer") as err:
        pins._pin_one("data.train_shards", SPEC, None, config)
    assert "\n" not in str(err.value)


def test_predict_scores_a_hub_spec_once_on_two_ranks_through_the_node_cache_at_one_commit(hub, tmp_path):
    """predict.py --out-dir over hf://: every key once, in order, at the commit pinned in the
    manifest; each shard sent once to the node (the cache), though --write-shards reads it again."""
    from tests.helpers.predicting import jsonl, model_folder

    model, out, shards = model_folder(tmp_path / "model"), tmp_path / "out", tmp_path / "shards"
    args = (str(model), SPEC, "--out-dir", str(out), "--out", str(tmp_path / "all.jsonl"), "--workers", "1")
    args += ("--cache-dir", str(tmp_path / "cache"), "--write-shards", str(shards))
    env = hub_env(hub, tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = run_script("predict.py", *args, env=env, ranks=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pinned = f"hf://datasets/{REPO}@{hub.commits[REPO]}"
    want = [f"{pinned}/train-{i:06d}.tar#s{sum(TRAIN[:i]) + n:07d}" for i, c in enumerate(TRAIN) for n in range(c)]
    assert [r["image"] for r in jsonl(tmp_path / "all.jsonl")] == want
    made = sorted((tmp_path / "made" / "train").glob("*.tar"))
    assert tar_counts(hub.cdn_bytes) == {f"{REPO}/{p.name}": p.stat().st_size for p in made}
    assert json.loads((out / "manifest.json").read_text())["pinned"] == [
        SPEC.replace(REPO, f"{REPO}@{hub.commits[REPO]}")
    ]
    assert [s["nsamples"] for s in json.loads((shards / "predicted.index.json").read_text())["shardlist"]] == TRAIN
