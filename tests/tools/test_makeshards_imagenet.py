"""wds-makeshards on ImageNet as it is handed out (a small replica: a train tar of class tars, a flat
val tar, its labels in the CSV, Kaggle and devkit forms), on a Parquet data set, under torchrun
and into a bucket: converted without extracting anything, every val image with its class, and
train.py trains and evaluates on the result."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import webdataset as wds

from tests.conftest import one_error_line, run_script
from tests.helpers import imagenet
from tests.helpers.training import SMALL_MODEL
from wdsdist.data.sources.index import read_index
from wdsdist.errors import UserError
from wdsdist.tools.convert import Inputs, Run, convert
from wdsdist.tools.planning import Options


def files_under(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def labelled(index):
    """{image path: class name} of the shards an index lists."""
    desc = read_index(str(index))
    out = {}
    for entry in desc["shardlist"]:
        for s in wds.WebDataset(os.path.join(os.path.dirname(index), entry["url"]), shardshuffle=False):
            meta = json.loads(s["json"])
            assert desc["classes"][int(s["cls"])] == meta["class"]
            out[meta["path"]] = meta["class"]
    return out


def makeshards(*args):
    proc = run_script("makeshards.py", *args)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet")
    imagenet.train_tar(root / "ILSVRC2012_img_train.tar", per_class=8)
    imagenet.val_tar(root / "ILSVRC2012_img_val.tar")
    return root, imagenet.val_labels(root)


def test_imagenet_tarballs_become_shards_without_extraction_and_train_py_trains_and_evaluates(replica, tmp_path):
    root, labels = replica
    before = files_under(root)
    out = tmp_path / "shards"
    makeshards("--source", str(root / "ILSVRC2012_img_train.tar"), "--shards", str(out), "--prefix", "train")
    train = out / "train.index.json"
    expected = {imagenet.val_name(i): imagenet.WNIDS[c] for i, c in enumerate(imagenet.VAL_CLASSES, 1)}
    for form in ("csv", "kaggle", "devkit"):
        extra = ["--devkit-classes", str(labels["synsets"])] if form == "devkit" else []
        val = tmp_path / form
        makeshards(
            *("--source", str(root / "ILSVRC2012_img_val.tar"), "--labels", str(labels[form]), *extra),
            *("--classes-from", str(train), "--shards", str(val), "--prefix", "val", "--workers", "2"),
        )
        got = {os.path.splitext(path)[0]: cls for path, cls in labelled(val / "val.index.json").items()}
        assert got == expected, form
    assert folder_bytes(tmp_path / "csv") == folder_bytes(tmp_path / "kaggle") == folder_bytes(tmp_path / "devkit")
    assert files_under(root) == before  # nothing extracted beside the tarballs
    assert sorted(set(labelled(train).values())) == imagenet.WNIDS and len(labelled(train)) == 24

    run = tmp_path / "run"
    args = [
        *(f"data.train_shards={train}", f"data.val_shards={tmp_path / 'devkit' / 'val.index.json'}"),
        *("data.synthetic=null", "data.image_size=32", "data.num_classes=3", SMALL_MODEL),
        *("trainer.batch_size=4", "trainer.workers=1", "trainer.steps=2", "trainer.eval_every=2"),
        *("loader.shuffle_buffer=8", f"run_dir={run}"),
    ]
    proc = run_script("train.py", *args)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_class_samples"] == [Counter(imagenet.VAL_CLASSES)[c] for c in range(3)]


def test_a_tar_of_class_folders_gives_the_class_tars_shards(tmp_path):
    imagenet.train_tar(tmp_path / "tars.tar", per_class=3)
    imagenet.train_tar(tmp_path / "folders.tar", per_class=3, folders=True)
    a = convert(Inputs(str(tmp_path / "tars.tar")), Options("t"), Run(str(tmp_path / "a")))
    b = convert(Inputs(str(tmp_path / "folders.tar")), Options("t"), Run(str(tmp_path / "b")))
    assert a["classes"] == b["classes"] == imagenet.WNIDS
    assert labelled(tmp_path / "a" / "t.index.json") == {
        path.removeprefix("train/"): cls for path, cls in labelled(tmp_path / "b" / "t.index.json").items()
    }


def test_a_damaged_class_tar_is_skipped_and_its_class_keeps_its_number(tmp_path):
    good = {"a.JPEG": imagenet.image(1), "b.JPEG": imagenet.image(2)}
    outer = {
        "n1.tar": imagenet.tar_bytes(good),
        "n2.tar": b"not a tar at all " * 64,
        "n3.tar": imagenet.tar_bytes(good),
    }
    (tmp_path / "train.tar").write_bytes(imagenet.tar_bytes(outer))
    desc = convert(Inputs(str(tmp_path / "train.tar")), Options("t"), Run(str(tmp_path / "out")))
    assert desc["classes"] == ["n1", "n2", "n3"] and desc["nsamples"] == 4
    assert sorted(labelled(tmp_path / "out" / "t.index.json").values()) == ["n1", "n1", "n3", "n3"]
    [skipped] = desc["skipped"]
    assert skipped["name"] == "n2/n2.tar" and skipped["reason"].startswith("a class tar damaged: not a readable tar")
    with pytest.raises(UserError, match=r"^--strict: .*train.tar:n2/n2.tar: a class tar damaged"):
        convert(Inputs(str(tmp_path / "train.tar")), Options("t"), Run(str(tmp_path / "strict"), strict=True))
    assert not (tmp_path / "strict").exists()


def test_classes_that_are_not_the_training_sets_are_refused_in_one_line(replica, tmp_path):
    root, labels = replica
    other = tmp_path / "other"
    (other / "n99999999").mkdir(parents=True)
    (other / "n99999999" / "a.jpg").write_bytes(imagenet.image(1))
    makeshards("--source", str(other), "--shards", str(other / "out"), "--prefix", "train")
    index = other / "out" / "train.index.json"
    proc = run_script(
        *("makeshards.py", "--source", str(root / "ILSVRC2012_img_val.tar"), "--labels", str(labels["csv"])),
        *("--classes-from", str(index), "--shards", str(tmp_path / "val")),
    )
    assert proc.returncode == 2 and not (tmp_path / "val").exists()
    assert one_error_line(proc) == (
        f"error: --labels {labels['csv']}: class n01440764 (3 in all) is not among the 1 classes of "
        f"--classes-from {index}"
    )
    proc = run_script(
        *("makeshards.py", "--source", str(root / "ILSVRC2012_img_train.tar"), "--classes-from", str(index)),
        *("--shards", str(tmp_path / "train")),
    )
    assert proc.returncode == 2
    assert "its 3 classes are not the 1 of --classes-from" in one_error_line(proc)


def test_a_parquet_data_set_becomes_shards_train_py_reads(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    labels = [i % 3 for i in range(12)]
    images = [{"bytes": imagenet.image(i), "path": f"img{i}.jpg"} for i in range(12)]
    features = {"image": {"_type": "Image"}, "label": {"names": imagenet.WNIDS, "_type": "ClassLabel"}}
    table = pa.table({"image": images, "label": labels})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet", row_group_size=5)
    out = tmp_path / "shards"
    makeshards("--source", str(tmp_path / "train-00000-of-00001.parquet"), "--shards", str(out), "--maxcount", "5")
    index = out / "train-00000-of-00001.index.json"
    desc = read_index(str(index))
    assert desc["classes"] == imagenet.WNIDS and desc["nsamples"] == 12 and desc["nshards"] == 3
    assert Counter(labelled(index).values()) == {w: 4 for w in imagenet.WNIDS}
    run = tmp_path / "run"
    args = [f"data.train_shards={index}", "data.val_shards=null", "data.synthetic=null", "data.image_size=32"]
    args += ["data.num_classes=3", SMALL_MODEL, "trainer.batch_size=4", "trainer.workers=1", "trainer.steps=1"]
    proc = run_script("train.py", *args, "loader.shuffle_buffer=4", f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 1


def test_parquet_rows_are_mixed_within_windows_of_row_groups():
    from wdsdist.tools.parquetsrc import windowed_shuffle

    rows = list(range(100))
    groups = list(range(0, 100, 10))  # 10 row groups of 10 rows
    order = windowed_shuffle(rows, groups, seed=1, window=3)
    assert sorted(order) == rows and order != rows
    windows = [order[:30], order[30:60], order[60:90], order[90:]]
    assert [len({r // 10 for r in w}) for w in windows] == [3, 3, 3, 1]  # each window: its 3 groups, mixed
    assert all(w != sorted(w) for w in windows[:3]) and windowed_shuffle(rows, groups, 1, 3) == order


def test_two_ranks_write_the_shards_of_one_process(tmp_path):
    imagenet.train_tar(tmp_path / "train.tar", per_class=6)
    common = ["makeshards.py", "--source", str(tmp_path / "train.tar"), "--maxcount", "4", "--workers", "1"]
    proc = run_script(*common, "--shards", str(tmp_path / "ranks"), ranks=2)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1: wrote 2 of its 2 shards; rank 0 writes the index" in proc.stdout
    makeshards(*common[1:], "--shards", str(tmp_path / "one"))
    assert folder_bytes(tmp_path / "ranks") == folder_bytes(tmp_path / "one")
    assert not (tmp_path / "ranks" / ".train.work").exists()


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """moto's S3 on loopback (a real HTTP server, as tests/data/sources/test_object_store.py runs it) with a bucket."""
    pytest.importorskip("moto")
    import threading

    import boto3
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    from wdsdist.data.sources import s3open

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    env |= {"AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    server = make_server("127.0.0.1", 0, DomainDispatcherApplication(create_backend_app), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{server.server_port}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s3open.reset_clients()
    client = boto3.client("s3")
    client.create_bucket(Bucket="shards")
    yield client
    s3open.reset_clients()
    server.shutdown()
    server.server_close()


def test_shards_into_a_bucket_equal_those_of_a_folder(tmp_path, bucket):
    imagenet.train_tar(tmp_path / "train.tar", per_class=4)
    folder = convert(Inputs(str(tmp_path / "train.tar")), Options("t", maxcount=5), Run(str(tmp_path / "local")))
    desc = convert(
        Inputs(str(tmp_path / "train.tar")), Options("t", maxcount=5), Run("s3://shards/imagenet", workers=2)
    )
    keys = [o["Key"] for o in bucket.list_objects_v2(Bucket="shards")["Contents"]]
    objects = {k.removeprefix("imagenet/"): bucket.get_object(Bucket="shards", Key=k)["Body"].read() for k in keys}
    local = folder_bytes(tmp_path / "local")
    assert desc["shardlist"] == folder["shardlist"] and desc["nsamples"] == 12
    tars = {k: v for k, v in objects.items() if k.endswith(".tar")}
    assert tars == {k: v for k, v in local.items() if k.endswith(".tar")} and len(tars) == 3
    assert objects["t.plan.json"] == local["t.plan.json"]
    assert json.loads(objects["t.index.json"])["shardlist"] == json.loads(local["t.index.json"])["shardlist"]
    again = convert(Inputs(str(tmp_path / "train.tar")), Options("t", maxcount=5), Run("s3://shards/imagenet"))
    assert again["written"] == 0


def test_member_names_that_climb_out_write_nothing_outside_and_keys_stay_inside(tmp_path):
    members = {
        "n1/../../../escaped.jpg": imagenet.image(1),
        "/abs/n2/rooted.jpg": imagenet.image(2),
        "n2/ok.jpg": imagenet.image(3),
        "n2/huge.jpg": imagenet.image(4, size=64),
    }
    (tmp_path / "evil.tar").write_bytes(imagenet.tar_bytes(members))
    out = tmp_path / "deep" / "out"
    before = files_under(tmp_path)
    makeshards("--source", str(tmp_path / "evil.tar"), "--shards", str(out), "--max-member", "4kB")
    added = set(files_under(tmp_path)) - set(before)
    assert added == {f"deep/out/{n}" for n in ("evil-000000.tar", "evil.index.json", "evil.plan.json")}
    desc = read_index(str(out / "evil.index.json"))
    assert desc["classes"] == ["n2"] and desc["nsamples"] == 2
    reasons = {s["name"]: s["reason"] for s in desc["skipped"]}
    assert reasons["n1/../../../escaped.jpg"] == "its name leads out of its folder ('..')"
    assert reasons["n2/huge.jpg"].endswith("more than the limit of 4000 (--max-member)") and len(reasons) == 2
    keys = [s["__key__"] for s in wds.WebDataset(str(out / "evil-000000.tar"), shardshuffle=False)]
    assert sorted(keys) == ["abs/n2/rooted", "n2/ok"]  # inside the shard, whatever the name said


def test_the_devkit_class_order_from_meta_mat_or_a_list_and_bad_label_files(tmp_path):
    scipy_io = pytest.importorskip("scipy.io")
    import numpy as np

    from wdsdist.tools import labels

    rows = [
        (1, imagenet.DEVKIT_ORDER[0]),
        (1001, "n00000001"),
        (2, imagenet.DEVKIT_ORDER[1]),
        (3, imagenet.DEVKIT_ORDER[2]),
    ]
    synsets = np.zeros((len(rows), 1), dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O")])
    for i, row in enumerate(rows):
        synsets[i, 0] = row
    scipy_io.savemat(tmp_path / "meta.mat", {"synsets": synsets})
    files = imagenet.val_labels(tmp_path)
    assert labels.devkit_wnids(str(tmp_path / "meta.mat")) == imagenet.DEVKIT_ORDER  # leaves only, in ID order
    from_mat = labels.read_labels(str(files["devkit"]), str(tmp_path / "meta.mat"))
    assert from_mat == labels.read_labels(str(files["devkit"]), str(files["synsets"]))
    assert from_mat == labels.read_labels(str(files["kaggle"])) == labels.read_labels(str(files["csv"]))
    with pytest.raises(UserError, match="numbers classes in its own order; name them with --devkit-classes"):
        labels.read_labels(str(files["devkit"]))
    (tmp_path / "two.csv").write_text("a.jpg,n1\na.JPEG,n2\n")
    with pytest.raises(UserError, match="two.csv: a has two classes, n1 and n2"):
        labels.read_labels(str(tmp_path / "two.csv"))
    (tmp_path / "short.csv").write_text("a.jpg\n")
    with pytest.raises(UserError, match=r"short.csv: row 1 'a.jpg' is not NAME,CLASS"):
        labels.read_labels(str(tmp_path / "short.csv"))
