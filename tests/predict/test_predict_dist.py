"""predict.py --out-dir over the ranks of a job (forked from the preloaded Python with torchrun's
environment: tests/preloaded.py): every sample once, in the spec's order, equal to one rank's
output; a job killed mid-way restarts by part; another model into the same folder is refused;
bad samples and shards are counted and named; folders are cut into parts; --features and
--write-shards. The model is an untrained ResNet-18 for 16-pixel images (tests/helpers/predicting.py).
hf:// and s3:// specs: tests/data/sources/test_hub_source.py and tests/data/sources/test_object_store.py."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
from pathlib import Path

import pytest
import webdataset as wds

from tests.conftest import jpeg, one_error_line, run_script, write_tiny_shards
from tests.helpers.predicting import jsonl, model_folder
from tests.helpers.training import free_port
from wdsdist.data.sources.index import write_index

COUNTS = [3, 1, 7, 2, 5, 4, 6, 1, 2, 8, 3, 2, 5, 1, 4, 2, 3]  # 17 shards of uneven sizes: 59 samples


def predict(*args: str, ranks: int | None = None, env: dict | None = None):
    env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    return run_script("predict.py", *args, ranks=ranks, env=env)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    model = model_folder(root / "model")
    index = write_tiny_shards(root / "shards", COUNTS, size=16)
    one = root / "one"
    proc = predict(str(model), str(index), "--out-dir", str(one), "--out", str(root / "one.jsonl"), "--workers", "0")
    assert proc.returncode == 0, proc.stderr
    return {"root": root, "model": model, "index": index, "one": jsonl(root / "one.jsonl")}


def same_predictions(got: list[dict], want: list[dict]) -> None:
    """Every key once, in the same order, the same classes, probabilities within 1e-5."""
    assert [r["image"] for r in got] == [r["image"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert [h["label"] for h in g["top"]] == [h["label"] for h in w["top"]], g["image"]
        assert all(abs(a["p"] - b["p"]) <= 1e-5 for a, b in zip(g["top"], w["top"], strict=True)), g["image"]


def test_one_rank_scores_every_sample_once_in_the_specs_order(data):
    keys = [r["image"].rsplit("#", 1)[1] for r in data["one"]]
    assert keys == [f"s{n:07d}" for n in range(sum(COUNTS))]
    shards = [r["image"].rsplit("#", 1)[0].rsplit("/", 1)[1] for r in data["one"]]
    assert shards == [f"tiny-{i:06d}.tar" for i, c in enumerate(COUNTS) for _ in range(c)]


@pytest.mark.slow
def test_three_ranks_of_two_workers_give_one_ranks_output_over_17_uneven_shards(data, tmp_path):
    out = tmp_path / "out"
    args = (str(data["model"]), str(data["index"]), "--out-dir", str(out), "--out", str(tmp_path / "all.jsonl"))
    proc = predict(*args, "--workers", "2", "--batch-size", "2", ranks=3)
    assert proc.returncode == 0, proc.stderr
    same_predictions(jsonl(tmp_path / "all.jsonl"), data["one"])
    assert "predict: 59 images, 0 skipped" in proc.stderr and "0 of 17 parts reused" in proc.stderr
    assert sorted(os.listdir(out / "parts")) == sorted(
        f"tiny-{i:06d}.{x}" for i in range(17) for x in ("json", "jsonl")
    )
    assert not list((out / "pieces").iterdir())  # the pieces of shards cut between ranks: joined
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["scored"] for p in manifest["parts"].values()] == COUNTS


@pytest.mark.slow
def test_two_shards_for_three_ranks_each_sample_once(data, tmp_path):
    spec = str(data["index"].parent / "tiny-{000008..000009}.tar")  # 2 + 8 samples
    out = tmp_path / "out"
    proc = predict(str(data["model"]), spec, "--out-dir", str(out), "--out", str(tmp_path / "two.jsonl"), ranks=3)
    assert proc.returncode == 0, proc.stderr
    want = [r for r in data["one"] if "tiny-000008" in r["image"] or "tiny-000009" in r["image"]]
    same_predictions(jsonl(tmp_path / "two.jsonl"), want)
    (out / "parts" / "tiny-000008.json").unlink()  # that part undone: 2 samples left for 3 ranks
    again = predict(str(data["model"]), spec, "--out-dir", str(out), "--out", str(tmp_path / "two.jsonl"), ranks=3)
    assert again.returncode == 0, again.stderr
    assert "predict: 2 images" in again.stderr and "1 of 2 parts reused" in again.stderr
    same_predictions(jsonl(tmp_path / "two.jsonl"), want)


@pytest.mark.slow
def test_a_rank_killed_mid_job_restarts_by_part_and_gives_the_same_output(data, tmp_path):
    out = tmp_path / "out"
    args = (str(data["model"]), str(data["index"]), "--out-dir", str(out), "--out", str(tmp_path / "all.jsonl"))
    kill = {"WDSDIST_TEST_KILL_RANK": "1", "WDSDIST_TEST_KILL_AFTER": "2"}
    killed = predict(*args, "--workers", "0", "--batch-size", "1", ranks=3, env=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "all.jsonl").exists()
    done = {p.stem: json.loads(p.read_text())["scored"] for p in (out / "parts").glob("*.json")}
    assert 1 <= len(done) < 17
    (out / "parts" / "tiny-000016.jsonl.tmp99").write_text("half a part")  # as a kill mid-write leaves
    again = predict(*args, "--workers", "0", "--batch-size", "1", ranks=3)
    assert again.returncode == 0, again.stderr
    assert not list(out.rglob("*.tmp*"))
    assert f"predict: {59 - sum(done.values())} images" in again.stderr
    assert f"{len(done)} of 17 parts reused" in again.stderr
    same_predictions(jsonl(tmp_path / "all.jsonl"), data["one"])


def test_another_model_into_the_same_folder_is_refused_in_one_line_and_nothing_changes(data, tmp_path):
    other = model_folder(tmp_path / "other", seed=1)
    folder = data["root"] / "one"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    proc = predict(str(other), str(data["index"]), "--out-dir", str(folder))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert str(folder) in line and "another model" in line, line
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_other_options_into_the_same_folder_are_refused_naming_them(data):
    folder = data["root"] / "one"
    proc = predict(str(data["model"]), str(data["index"]), "--out-dir", str(folder), "--top-k", "2")
    assert proc.returncode == 2
    assert "top_k: 5 there, 2 now" in one_error_line(proc)


def test_the_same_command_again_reuses_every_part(data, tmp_path):
    out = tmp_path / "again.jsonl"
    proc = predict(str(data["model"]), str(data["index"]), "--out-dir", str(data["root"] / "one"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "predict: 0 images, 0 skipped" in proc.stderr and "17 of 17 parts reused" in proc.stderr
    same_predictions(jsonl(out), data["one"])


def bad_shards(folder: Path) -> Path:
    """Shards of 4, 5 and 3 samples, the sixth sample's JPEG garbage, and an index that names a
    fourth shard of 2 that is not there (yet)."""
    folder.mkdir()
    shards, n = [], 0
    for i, count in enumerate([4, 5, 3]):
        path = folder / f"b-{i:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for _ in range(count):
                image = b"not an image" if n == 6 else jpeg(n, 16)[0]
                sink.write({"__key__": f"k{n:04d}", "jpg": image, "cls": "1"})
                n += 1
        shards.append((str(path), count))
    shards.append((str(folder / "b-000003.tar"), 2))
    index = folder / "b.index.json"
    write_index(str(index), shards, name="b")
    return index


def test_two_ranks_decode_only_what_they_score_and_warn_a_corrupt_sample_once(data, tmp_path):
    index = bad_shards(tmp_path / "bad")
    spec = str(index.parent / "b-{000000..000002}.tar")  # the three shards that exist
    proc = predict(str(data["model"]), spec, "--out-dir", str(tmp_path / "out"), "--batch-size", "4", ranks=2)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("k0006") == 1  # each rank reads its own span only: no padding decoded
    assert "predict: 11 images, 1 skipped" in proc.stderr


def test_a_corrupt_sample_is_named_and_counted_and_a_missing_shards_part_waits_for_the_next_run(data, tmp_path):
    index = bad_shards(tmp_path / "bad")
    out = tmp_path / "out"
    args = (
        str(data["model"]),
        str(index),
        "--out-dir",
        str(out),
        "--out",
        str(tmp_path / "all.jsonl"),
        "--workers",
        "0",
    )
    first = predict(*args)
    assert first.returncode == 1, first.stderr
    assert "predict: 11 images, 3 skipped" in first.stderr  # the garbage JPEG, the 2 of the missing shard
    assert "1 parts not done (their shards could not be read: " + str(index.parent / "b-000003.tar") in first.stderr
    assert "k0006" in first.stderr and not (tmp_path / "all.jsonl").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["parts"]) == ["b-000000", "b-000001", "b-000002"]
    assert manifest["parts"]["b-000001"]["skipped"] == [f"{index.parent / 'b-000001.tar'}#k0006"]  # by its key
    with wds.TarWriter(str(index.parent / "b-000003.tar")) as sink:  # the shard comes back
        for n in (12, 13):
            sink.write({"__key__": f"k{n:04d}", "jpg": jpeg(n, 16)[0], "cls": "1"})
    again = predict(*args)
    assert again.returncode == 0, again.stderr
    assert "predict: 2 images, 0 skipped" in again.stderr and "3 of 4 parts reused" in again.stderr
    keys = [r["image"].rsplit("#", 1)[1] for r in jsonl(tmp_path / "all.jsonl")]
    assert keys == [f"k{n:04d}" for n in range(14) if n != 6]


def test_strict_stops_at_a_missing_shard_naming_it(data, tmp_path):
    index = bad_shards(tmp_path / "bad")
    proc = predict(str(data["model"]), str(index), "--out-dir", str(tmp_path / "out"), "--strict", "--workers", "1")
    assert proc.returncode == 2
    assert "b-000003.tar: cannot read shard" in one_error_line(proc)


def test_a_folder_is_listed_once_cut_into_parts_and_shared_by_the_ranks(data, tmp_path):
    for c in "ab":
        (tmp_path / "images" / c).mkdir(parents=True)
        for i in range(7):
            (tmp_path / "images" / c / f"{i:02d}.jpg").write_bytes(jpeg(i + 10 * (c == "b"), 16)[0])
    bad = tmp_path / "images" / "a" / "03.jpg"
    bad.write_bytes(b"not an image")
    runs = {}
    for ranks in (None, 2):
        out = tmp_path / f"out-{ranks}"
        proc = predict(
            str(data["model"]), str(tmp_path / "images"), "--out-dir", str(out), "--out", str(out) + ".csv",
            "--part-size", "4", "--workers", "1", ranks=ranks,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "predict: 13 images, 1 skipped" in proc.stderr and "0 of 4 parts reused" in proc.stderr
        assert sorted(p.name for p in (out / "parts").glob("*.json")) == [f"images-{i:06d}.json" for i in range(4)]
        assert json.loads((out / "parts" / "images-000000.json").read_text())["skipped"] == [str(bad)]
        runs[ranks] = list(csv.reader((Path(f"{out}.csv")).open()))
    assert [row[0] for row in runs[None][1:]] == sorted(
        str(p) for p in (tmp_path / "images").rglob("*.jpg") if p != bad
    )
    assert runs[2] == runs[None]


@pytest.fixture(scope="module")
def featured(data, tmp_path_factory):
    """Two ranks over 2 + 8 samples (cut between them) with --features and --write-shards."""
    root = tmp_path_factory.mktemp("featured")
    spec = str(data["index"].parent / "tiny-{000008..000009}.tar")
    out, shards = root / "out", root / "shards"
    args = (str(data["model"]), spec, "--out-dir", str(out), "--features", "--write-shards", str(shards))
    proc = predict(*args, "--batch-size", "3", "--workers", "0", ranks=2)
    assert proc.returncode == 0, proc.stderr
    return {"out": out, "shards": shards, "args": args}


@pytest.mark.slow
def test_features_are_one_float16_array_per_part_equal_to_the_models_penultimate_output(data, featured):
    import numpy as np
    import torch

    from wdsdist.data import LoaderConfig, decode_eval
    from wdsdist.model.classify import Penultimate, load_model

    out = featured["out"]
    model, config = load_model(str(data["model"]))
    hook = Penultimate(model)
    cfg = LoaderConfig(batch_size=1, image_size=16, eval_resize=config["resize"], train=False)
    for shard in ("tiny-000008", "tiny-000009"):
        got = np.load(out / "parts" / f"{shard}.npy")
        samples = list(wds.WebDataset(str(data["index"].parent / f"{shard}.tar"), shardshuffle=False))
        with torch.no_grad():
            model(torch.stack([decode_eval(s["jpg"], cfg) for s in samples]).float())
        want = hook.features.numpy()
        assert got.dtype == np.float16 and got.shape == want.shape == (len(samples), 512)
        assert np.abs(got.astype(np.float32) - want).max() <= 1e-2
        keys = [r["image"].rsplit("#", 1)[1] for r in jsonl(out / "parts" / f"{shard}.jsonl")]
        assert keys == [s["__key__"] for s in samples]  # the features' rows in the part's order


def test_a_torchvision_name_loads_its_pretrained_weights_or_stops_in_one_line_naming_the_file(tmp_path):
    offline = {
        "TORCH_HOME": str(tmp_path / "torch"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
    }
    proc = predict("resnet18", str(tmp_path), "--out-dir", str(tmp_path / "out"), "--features", env=offline)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith("error: resnet18: its pretrained weights cannot be loaded") and "resnet18-" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_write_shards_writes_each_shard_again_with_its_predictions_which_train_py_reads(data, featured, tmp_path):
    import numpy as np

    from wdsdist.data import Loader, LoaderConfig

    out, shards, args = featured["out"], featured["shards"], featured["args"]
    index = json.loads((shards / "predicted.index.json").read_text())
    assert [(s["url"], s["nsamples"]) for s in index["shardlist"]] == [("tiny-000008.tar", 2), ("tiny-000009.tar", 8)]
    samples = {
        s["__key__"]: s
        for name in ("tiny-000008", "tiny-000009")
        for s in wds.WebDataset(str(shards / f"{name}.tar"), shardshuffle=False)
    }
    parts = {
        r["image"].rsplit("#", 1)[1]: r["top"]
        for name in ("tiny-000008", "tiny-000009")
        for r in jsonl(out / "parts" / f"{name}.jsonl")
    }
    assert {k: json.loads(s["pred.json"])["top"] for k, s in samples.items()} == parts
    feats = np.concatenate([np.load(out / "parts" / f"{name}.npy") for name in ("tiny-000008", "tiny-000009")])
    assert np.array_equal(np.stack([np.load(io.BytesIO(s["emb.npy"])) for s in samples.values()]), feats)
    cfg = LoaderConfig(batch_size=2, image_size=16, mode="epoch", workers=0, with_keys=True, num_classes=10)
    read = [
        (k, int(label))
        for b in Loader(str(shards / "predicted.index.json"), cfg)
        for k, label in zip(b["key"], b["label"], strict=True)
    ]
    assert sorted(read) == sorted((k, int(s["cls"])) for k, s in samples.items())
    run = tmp_path / "run"  # and train.py trains on them as on any shards
    trained = run_script(
        "train.py", f"data.train_shards={shards / 'predicted.index.json'}", "data.val_shards=null",
        "data.synthetic=null", "data.image_size=32", "data.num_classes=10", "model.name=squeezenet1_1",
        "trainer.batch_size=4", "trainer.workers=0", "trainer.steps=2", "trainer.ckpt_every=0", f"run_dir={run}",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert json.loads((run / "summary.json").read_text())["rank_steps"] == [2]
    again = predict(*args, "--write-shards", str(data["index"].parent))  # over the input shards: refused
    assert "it would write over the input shard" in one_error_line(again)


def test_a_parquet_output_without_pyarrow_is_refused_naming_the_extra(data, tmp_path):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        proc = predict(
            str(data["model"]),
            str(data["index"]),
            "--out-dir",
            str(tmp_path / "o"),
            "--out",
            str(tmp_path / "p.parquet"),
        )
        assert proc.returncode == 2
        assert "pip install 'wds-distributed[parquet]'" in one_error_line(proc)
        assert not (tmp_path / "o").exists()
    else:
        pytest.skip("pyarrow is installed here: parquet is written")


def test_part_names_from_shard_urls_stay_inside_the_parts_folder():
    from wdsdist.predict.parts import part_names

    hostile = ["s3://b/../../etc/passwd.tar", "http://h/a/..", "/x/.hidden.tar", "hf://datasets/o/n@sha/x y?.tar"]
    names = part_names(hostile)
    assert names == ["passwd", "shard", "hidden", "x_y"]
    assert all("/" not in n and not n.startswith(".") and n not in ("", "..") for n in names)
    assert part_names(["s3://a/x/000.tar", "s3://a/y/000.tar"]) == ["000000-000", "000001-000"]  # never one part twice


def test_decode_gpu_without_a_gpu_is_refused_in_one_line_before_any_file(data, tmp_path):
    proc = predict(
        str(data["model"]), str(data["index"]), "--out-dir", str(tmp_path / "o"), "--decode", "gpu", "--device", "cpu"
    )
    assert proc.returncode == 2
    assert "--decode gpu" in one_error_line(proc) and not (tmp_path / "o").exists()


def test_the_progress_bar_on_rank_0_counts_every_ranks_images_from_the_store(monkeypatch):
    import io
    import sys

    import torch

    from wdsdist.cluster import distributed
    from wdsdist.predict.progress import Progress

    class Store:  # every rank's images so far, as the job's store counts them
        def add(self, key, n):
            assert key == "wdsdist/predict/images/0"
            return 42

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(distributed, "watch_store", lambda timeout: Store())
    with Progress(distributed.Dist(0, 3, 0, torch.device("cpu")), total=59) as progress:
        progress.advance(5)  # rank 0's own: the store's count is the bar's, not this
    assert "42/59" in sys.stderr.getvalue().replace("\r", "\n").splitlines()[-1]


@pytest.mark.parametrize("name", ["resnet18", "timm/resnet18"])
def test_a_model_name_brings_its_classes_preprocessing_and_penultimate_features(name, monkeypatch):
    """A torchvision or timm name as the model (weights faked here: none are fetched in tests)."""
    import torch
    import torchvision

    from wdsdist.model import classify, weights

    def timm_model(model: str, num_classes: int, pretrained: bool):
        import timm

        return timm.create_model(model, num_classes=num_classes)

    monkeypatch.setattr(weights, "state_dict", lambda found: torchvision.models.get_model("resnet18").state_dict())
    monkeypatch.setattr(classify, "timm_model", timm_model)
    model, config = classify.load_model(name)
    assert config["num_classes"] == len(config["classes"]) == 1000 and config["classes"][0].startswith("tench")
    assert (config["image_size"], config["resize"]) == ((224, 236) if name.startswith("timm/") else (224, 256))
    hook = classify.Penultimate(model)
    with torch.no_grad():
        model(torch.rand(2, 3, 32, 32) * 255)
    assert hook.features.shape == (2, 512)


def test_a_rank_that_does_not_see_the_output_folder_is_named_in_one_line(data, monkeypatch, tmp_path):
    """On several nodes the folder must be shared: rank 0 names the first rank that does not see
    its manifest, in one line, before anything is scored (here rank 1 of two is made blind)."""
    from wdsdist.cluster import distributed
    from wdsdist.data import UserError
    from wdsdist.predict import job as predict_job
    from wdsdist.predict.cli import options

    out = tmp_path / "out"
    args = options([str(data["model"]), str(data["index"]), "--out-dir", str(out), "--workers", "0"])
    monkeypatch.setattr(distributed, "all_gather_object", lambda seen: [True, False])
    with pytest.raises(UserError) as refused:
        predict_job.run_job(args)
    assert str(refused.value) == f"--out-dir {out}: rank 1 does not see rank 0's files there: use a shared folder"
    assert not list((out / "parts").glob("*.jsonl"))  # nothing scored
