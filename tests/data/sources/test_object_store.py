"""s3:// and gs:// shards, read natively (boto3, no shell) from a real S3 API on loopback.

One moto S3 server per module, in this process, behind a WSGI layer that logs every request
(method, path, Range) and lets a test tell ranks apart: an endpoint ending in ``/rN`` reaches
the same store, and the layer records N. Fake credentials come from the environment, and the
machine's own AWS configuration is kept out.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from tests.conftest import one_error_line, run_script, write_tiny_shards
from tests.helpers.loading import cfg, keys_and_bad
from tests.helpers.training import free_port, overrides, ranks
from wdsdist.data.delivery.pipeline import make_eval_loader
from wdsdist.data.sources import httpopen, retry, s3open, shardspec
from wdsdist.errors import DataError, UserError

BUCKET = "wds-test"
TRAIN_COUNTS = [24] * 4
VAL_COUNTS = [10, 7, 5]
DRIP_INTERVAL = 0.02  # seconds between the bytes of the dripping object
DRIP_TIMEOUT = 0.5  # data.http_timeout in the drip test: each byte comes well within it


class _Store:
    """moto's S3 app, logging each request; ``/rN/...`` is ``/...`` asked by rank N."""

    def __init__(self, app):
        self.app, self.log = app, []
        self.cut: set[str] = set()  # paths whose next GET sends half the body, then nothing more

    def __call__(self, environ, start_response):
        path, rank = environ["PATH_INFO"], None
        match = re.match(r"^/r(\d+)(/.*)$", path)
        if match:
            rank, path = int(match[1]), match[2]
            environ["PATH_INFO"] = path
            for key in ("RAW_URI", "REQUEST_URI"):
                if key in environ:
                    environ[key] = environ[key][len(match[0]) - len(path) :]
        self.log.append((rank, environ["REQUEST_METHOD"], path, environ.get("HTTP_RANGE")))
        if path == f"/{BUCKET}/drip/slow.tar" and environ["REQUEST_METHOD"] == "GET":
            start_response("200 OK", [("Content-Length", "100000"), ("Content-Type", "application/x-tar")])
            return self._drip()
        if path in self.cut and environ["REQUEST_METHOD"] == "GET":
            self.cut.discard(path)
            body = b"".join(self.app(environ, start_response))
            return [body[: len(body) // 2]]  # and the rest never comes
        return self.app(environ, start_response)

    @staticmethod
    def _drip():
        for _ in range(1000):  # 20 s at most, so no thread outlives a broken test
            yield b"\0"
            time.sleep(DRIP_INTERVAL)

    def gets(self, suffix: str = ".tar") -> list[tuple[int | None, str]]:
        return [(rank, path) for rank, method, path, _ in self.log if method == "GET" and path.endswith(suffix)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The server, its bucket (train/ and val/ shards with their indexes) and the local copies."""
    root = tmp_path_factory.mktemp("object-store")
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(root / "no-aws-config"),  # the machine's own profiles stay out
        "AWS_SHARED_CREDENTIALS_FILE": str(root / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-role probe when a test takes the keys away
    }
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        app = _Store(DomainDispatcherApplication(create_backend_app))
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{server.server_port}"
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        local = {}
        for split, counts in (("train", TRAIN_COUNTS), ("val", VAL_COUNTS)):
            index = write_tiny_shards(root / split, counts, split, size=32)
            local[split] = index.parent
            for path in index.parent.iterdir():  # the index's entries are relative: it works as is
                client.put_object(Bucket=BUCKET, Key=f"{split}/{path.name}", Body=path.read_bytes())
        s3open.reset_clients()
        yield {"endpoint": endpoint, "client": client, "app": app, "local": local, "root": root}
        s3open.reset_clients()
        server.shutdown()
        server.server_close()


def train_spec(scheme: str = "s3") -> str:
    return f"{scheme}://{BUCKET}/train/train-{{000000..{len(TRAIN_COUNTS) - 1:06d}}}.tar"


VAL_INDEX = f"s3://{BUCKET}/val/val.index.json"


def quoted(value: str) -> str:
    return f"'{value}'"  # Hydra's grammar: braces and colons inside a quoted value


# ---------------------------------------------------------------- training, makeshards, simdist


def test_training_from_s3_brace_spec_and_index(store, tmp_path, monkeypatch):
    # The endpoint from boto3's own AWS_ENDPOINT_URL (train) and the config key (val) alike.
    monkeypatch.setenv("AWS_ENDPOINT_URL", store["endpoint"])
    del store["app"].log[:]
    run = tmp_path / "run"
    proc = run_script(
        "train.py",
        *overrides({"train": quoted(train_spec()), "val": quoted(VAL_INDEX)}, run, "trainer.steps=6"),
        f"data.s3_endpoint_url={quoted(store['endpoint'])}",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rank_steps"] == [6] and summary["val_samples"] == sum(VAL_COUNTS)
    fetched = {path for _, path in store["app"].gets()}
    assert {f"/{BUCKET}/train/train-{i:06d}.tar" for i in range(len(TRAIN_COUNTS))} <= fetched
    assert {f"/{BUCKET}/val/val-{i:06d}.tar" for i in range(len(VAL_COUNTS))} <= fetched
    assert (None, f"/{BUCKET}/val/val.index.json") in store["app"].gets(".json")


def test_makeshards_index_of_an_s3_spec_uploads_it_and_simdist_reads_it(store, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", store["endpoint"])
    uploaded = f"s3://{BUCKET}/train/made.index.json"
    proc = run_script("makeshards.py", "--index", train_spec(), "--output", uploaded)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"indexed 4 shards, 96 samples -> {uploaded}" in proc.stdout
    body = store["client"].get_object(Bucket=BUCKET, Key="train/made.index.json")["Body"].read()
    desc = json.loads(body)
    assert desc["shardlist"] == [{"url": f"train-{i:06d}.tar", "nsamples": 24} for i in range(4)]
    # A local --output keeps the objects' full URLs (in-process: one torch start-up less).
    from wdsdist.tools import makeshards

    local = tmp_path / "made.index.json"
    s3open.reset_clients()  # AWS_ENDPOINT_URL is read when a client is made
    makeshards.index_only(train_spec(), str(local))
    local_shards = str(store["local"]["train"] / "train-{000000..000001}.tar")
    with pytest.raises(UserError, match=r"an index in a bucket names objects, and .*train-000000.tar is not one"):
        makeshards.index_only(local_shards, f"s3://{BUCKET}/local.index.json")
    urls = [e["url"] for e in json.loads(local.read_text())["shardlist"]]
    assert urls == [f"s3://{BUCKET}/train/train-{i:06d}.tar" for i in range(4)]
    # simdist, real mode, on the uploaded index: the loader reads every shard from the store.
    del store["app"].log[:]
    proc = run_script("simdist.py", "--shards", uploaded, "--size", "2", "--nworkers", "1", "--batch-size", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: same batches in all ranks (6 per rank per epoch)" in proc.stdout
    assert {p for _, p in store["app"].gets()} == {f"/{BUCKET}/train/train-{i:06d}.tar" for i in range(4)}


def test_two_ranks_each_open_only_their_own_objects(store, tmp_path):
    # Each rank's endpoint ends in /r$RANK (resolved in that rank's process): the server's log
    # says which rank asked for which object.
    del store["app"].log[:]
    run = tmp_path / "run"
    endpoint = store["endpoint"] + "/r${oc.env:RANK}"
    proc = ranks(
        2,
        *overrides(
            {"train": quoted(f"s3://{BUCKET}/train/train.index.json"), "val": quoted(VAL_INDEX)},
            run,
            "trainer.steps=8",
            "trainer.workers=1",
            f"data.s3_endpoint_url={quoted(endpoint)}",
        ),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world"] == 2 and summary["rank_steps"] == [8, 8]
    assert summary["val_samples"] == sum(VAL_COUNTS)
    opened: dict[int, set[str]] = {}
    for rank, path in store["app"].gets():
        opened.setdefault(rank, set()).add(path.rsplit("/", 1)[1])
    train = [f"train-{i:06d}.tar" for i in range(4)]
    val = [f"val-{i:06d}.tar" for i in range(3)]
    # shards[rank::world] of each set, every one of them read, nothing of the other rank's.
    assert opened == {0: {train[0], train[2], val[0], val[2]}, 1: {train[1], train[3], val[1]}}


# ---------------------------------------------------------------- gs://, byte ranges, slow stores


def test_gs_spec_through_its_endpoint_override(store, monkeypatch):
    # AWS_ENDPOINT_URL points at nothing: gs:// goes to data.gs_endpoint_url, never there.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    s3open.reset_clients()
    del store["app"].log[:]
    loader = make_eval_loader(train_spec("gs"), 0, 1, cfg(gs_endpoint_url=store["endpoint"]))
    keys, bad = keys_and_bad(loader)
    assert sorted(keys) == [f"s{i:07d}" for i in range(sum(TRAIN_COUNTS))] and bad == [0, 0]
    assert len(store["app"].gets()) == len(TRAIN_COUNTS)
    shards = shardspec.expand(
        f"gs://{BUCKET}/val/val.index.json", access=shardspec.Access(gs_endpoint_url=store["endpoint"])
    )
    assert [s.url for s in shards] == [f"gs://{BUCKET}/val/val-{i:06d}.tar" for i in range(3)]


def test_byte_range_open(store):
    url, local = f"s3://{BUCKET}/train/train-000001.tar", store["local"]["train"] / "train-000001.tar"
    data = local.read_bytes()
    del store["app"].log[:]
    with s3open.open_url(url, 10.0, start=512, end=1536, endpoint_url=store["endpoint"]) as f:
        assert f.read() == data[512:1536]
    with s3open.open_url(url, 10.0, start=len(data) - 1024, endpoint_url=store["endpoint"]) as f:
        assert f.read() == data[-1024:]
    assert [r for *_, r in store["app"].log] == ["bytes=512-1535", f"bytes={len(data) - 1024}-"]
    with pytest.raises(OSError, match=rf"byte range beyond the object's end \({len(data)} bytes\)"):
        s3open.open_url(url, 10.0, start=len(data) + 10, endpoint_url=store["endpoint"])


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_span_entry_of_an_object_is_one_ranged_get_of_its_bytes(store, tmp_path, scheme):
    """loader.shard_order=node caches a node's part of a shared shard as a span entry: from an
    object store as from http, one GET with exactly the span's Range, and later reads a hit."""
    from wdsdist.data.sources import opener

    url, local = f"{scheme}://{BUCKET}/train/train-000002.tar", store["local"]["train"] / "train-000002.tar"
    data = local.read_bytes()
    lo, hi = 1024, len(data) - 2048
    access = opener.Access(
        cache_dir=str(tmp_path / "cache"), http_retry_s=0, **{f"{scheme}_endpoint_url": store["endpoint"]}
    )
    del store["app"].log[:]
    for start in (lo + 512, lo, hi - 1):
        with opener.open_shard(url, access, start=start, span=(lo, hi)) as stream:
            assert stream.read() == data[start:hi]
    ranges = [r for _, method, path, r in store["app"].log if method == "GET" and path.endswith(".tar")]
    assert ranges == [f"bytes={lo}-{hi - 1}"]
    [entry] = (tmp_path / "cache").glob("*.data")
    assert entry.name.endswith(f"-train-000002.tar.{lo}-{hi}.data") and entry.stat().st_size == hi - lo


def test_http_byte_range_open_and_a_server_that_ignores_it(tmp_path):
    import http.server

    data = bytes(range(256)) * 8

    class Ranged(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            wanted = self.headers.get("Range")
            if self.path == "/ranged" and wanted:
                first, _, last = wanted.removeprefix("bytes=").partition("-")
                lo, hi = int(first), int(last) + 1 if last else len(data)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{len(data)}")
                body = data[lo:hi]
            else:  # no Range support: the whole file, as Python's http.server does
                self.send_response(200)
                body = data
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ranged)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with httpopen.open_url(f"{base}/ranged", 10.0, start=100, end=300) as r:
            assert r.read() == data[100:300]
        with httpopen.open_url(f"{base}/ranged", 10.0, start=2000) as r:
            assert r.read() == data[2000:]
        # A server that ignores Range: its bytes before the offset are read and dropped.
        with httpopen.open_url(f"{base}/plain", 10.0, start=100, end=300) as r:
            assert r.read() == data[100:300]
    finally:
        server.shutdown()
        server.server_close()


def test_an_object_read_cut_mid_body_is_resumed_from_the_byte_reached(store, monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE", 0.005)
    url, local = f"s3://{BUCKET}/train/train-000002.tar", store["local"]["train"] / "train-000002.tar"
    store["app"].cut.add(f"/{BUCKET}/train/train-000002.tar")
    del store["app"].log[:]
    # The server hangs up after the half it sent; were it to wait instead, the read would time out.
    config = cfg(http_timeout=DRIP_TIMEOUT, s3_endpoint_url=store["endpoint"])
    keys, bad = keys_and_bad(make_eval_loader([shardspec.Shard(url, 24)], 0, 1, config))
    assert keys == keys_and_bad(make_eval_loader([shardspec.Shard(str(local), 24)], 0, 1, cfg()))[0]
    assert bad == [0, 0]
    ranges = [r for *_, r in store["app"].log]
    size = len(local.read_bytes())
    assert ranges[0] is None and ranges[1:] == [f"bytes={size // 2}-"]  # once more, from the byte reached


def test_a_dripping_store_fails_its_shard_naming_url_and_reason(store, capfd):
    slow, good = f"s3://{BUCKET}/drip/slow.tar", f"s3://{BUCKET}/train/train-000000.tar"
    shards = [shardspec.Shard(slow, 6), shardspec.Shard(good, 24)]
    # data.http_retry_s=0: the first try's failure (a drip is transient, else retried)
    config = cfg(http_timeout=DRIP_TIMEOUT, http_retry_s=0, s3_endpoint_url=store["endpoint"])
    keys, bad = keys_and_bad(make_eval_loader(shards, 0, 1, config))
    assert sorted(keys) == [f"s{i:07d}" for i in range(24)]  # the good shard, whole
    err = capfd.readouterr().err
    assert f"warning: skipped: {slow}: cannot read shard: TimeoutError: too slow: " in err
    assert "less than http_min_rate=65536 bytes/s" in err


# ---------------------------------------------------------------- errors name the URL


def test_a_missing_or_refused_shard_is_skipped_and_counted(store, capfd):
    missing_key = f"s3://{BUCKET}/train/train-000099.tar"
    missing_bucket = "s3://no-such-bucket/train-000000.tar"
    good = f"s3://{BUCKET}/train/train-000002.tar"
    shards = [shardspec.Shard(u, 24) for u in (missing_key, missing_bucket, good)]
    keys, bad = keys_and_bad(make_eval_loader(shards, 0, 1, cfg(s3_endpoint_url=store["endpoint"])))
    assert sorted(keys) == [f"s{i:07d}" for i in range(48, 72)] and bad[1] == 2
    err = capfd.readouterr().err
    at = store["endpoint"]
    assert (
        f"{missing_key}: cannot read shard: FileNotFoundError: no object 'train/train-000099.tar' "
        f"in bucket '{BUCKET}' at {at}"
    ) in err
    assert f"{missing_bucket}: cannot read shard: FileNotFoundError: no bucket 'no-such-bucket' at {at}" in err
    with pytest.raises(DataError, match=r"s3://.*: cannot read shard: FileNotFoundError: no (object|bucket)"):
        list(make_eval_loader(shards, 0, 1, cfg(strict=True, s3_endpoint_url=store["endpoint"])))


def test_an_unreachable_endpoint_is_named(store, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries would only repeat the refusal
    s3open.reset_clients()
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"cannot reach {dead}"):
        s3open.open_url(f"s3://{BUCKET}/train/train-000000.tar", 5.0, endpoint_url=dead)
    s3open.reset_clients()


def simdist_plan(spec: str, **env: str):
    return run_script("simdist.py", "--plan", "--shards", spec, env=env, timeout=120)


@pytest.mark.parametrize(
    "case",
    ["missing-key", "missing-bucket", "no-credentials", "no-such-profile", "outside-the-bucket"],
)
def test_startup_errors_are_one_line_naming_the_url(store, case):
    at = store["endpoint"]
    env = {"AWS_ENDPOINT_URL": at}
    if case == "missing-key":
        spec, want = f"s3://{BUCKET}/nope/x.index.json", f"no object 'nope/x.index.json' in bucket '{BUCKET}' at {at}"
    elif case == "missing-bucket":
        spec, want = "s3://no-such-bucket/x.index.json", f"no bucket 'no-such-bucket' at {at}"
    elif case == "outside-the-bucket":
        store["client"].put_object(
            Bucket=BUCKET,
            Key="evil/evil.index.json",
            Body=json.dumps({"shardlist": [{"url": "s3://other-bucket/x.tar", "nsamples": 1}]}).encode(),
        )
        spec, want = (
            f"s3://{BUCKET}/evil/evil.index.json",
            (
                f"s3://{BUCKET}/evil/evil.index.json: shardlist[0]: refused 's3://other-bucket/x.tar': "
                f"not in the index's own bucket s3://{BUCKET}/ (data.trust_index=true allows it)"
            ),
        )
    elif case == "no-such-profile":
        env |= {"AWS_PROFILE": "nope"}
        spec, want = f"s3://{BUCKET}/train/train.index.json", "The config profile (nope) could not be found"
    else:
        env |= {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
        spec = f"s3://{BUCKET}/train/train.index.json"
        want = "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    proc = simdist_plan(spec, **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert want in line
    if case != "outside-the-bucket":
        assert line.startswith("error: ") and "s3://" in line


def test_training_without_credentials_is_one_line(store, tmp_path):
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_ENDPOINT_URL": store["endpoint"]}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        proc = run_script("train.py", *overrides({"train": quoted(train_spec()), "val": quoted(VAL_INDEX)}, tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line.startswith(f"error: data.train_shards: s3://{BUCKET}/train/train-000000.tar: no credentials")


def test_access_denied_is_named(store, capfd):
    """moto checks credentials and IAM policies once told to: a user without any policy."""
    import boto3
    from moto import settings

    iam = boto3.client("iam", endpoint_url=store["endpoint"])
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    at = store["endpoint"]
    shard = f"s3://{BUCKET}/train/train-000000.tar"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        mp.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        mp.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        s3open.reset_clients()
        try:
            with pytest.raises(UserError, match=f"cannot read shard index {VAL_INDEX}: access denied by {at}"):
                shardspec.expand(VAL_INDEX, access=shardspec.Access(s3_endpoint_url=at))
            loader = make_eval_loader([shardspec.Shard(shard, 24)], 0, 1, cfg(s3_endpoint_url=at))
            with pytest.raises(DataError, match="read no sample"):
                keys_and_bad(loader)
            assert f"{shard}: cannot read shard: PermissionError: access denied by {at} (AccessDenied" in (
                capfd.readouterr().err
            )
            mp.setenv("AWS_ACCESS_KEY_ID", "unknown-key")  # a key the store does not know
            s3open.reset_clients()
            with pytest.raises(PermissionError, match=f"credentials refused by {at} \\(InvalidAccessKeyId"):
                s3open.open_url(shard, 10.0, endpoint_url=at)
        finally:
            s3open.reset_clients()


def test_an_s3_index_resolves_relative_entries_and_keeps_them_in_its_folder(store):
    index = f"s3://{BUCKET}/nested/a/b.index.json"
    entries = [
        {"url": "x.tar", "nsamples": 1},
        {"url": "sub/y.tar", "nsamples": 1},
        {"url": f"s3://{BUCKET}/z.tar", "nsamples": 1},
    ]
    store["client"].put_object(
        Bucket=BUCKET, Key="nested/a/b.index.json", Body=json.dumps({"shardlist": entries}).encode()
    )
    access = shardspec.Access(s3_endpoint_url=store["endpoint"])
    urls = [s.url for s in shardspec.expand(index, access=access)]
    assert urls == [f"s3://{BUCKET}/nested/a/x.tar", f"s3://{BUCKET}/nested/a/sub/y.tar", f"s3://{BUCKET}/z.tar"]
    store["client"].put_object(
        Bucket=BUCKET,
        Key="nested/a/up.index.json",
        Body=json.dumps({"shardlist": [{"url": "../x.tar", "nsamples": 1}]}).encode(),
    )
    with pytest.raises(UserError, match=r"refused '\.\./x\.tar': it leads outside the index's folder"):
        shardspec.expand(f"s3://{BUCKET}/nested/a/up.index.json", access=access)
    trusted = shardspec.expand(
        f"s3://{BUCKET}/nested/a/up.index.json",
        access=shardspec.Access(trust_index=True, s3_endpoint_url=store["endpoint"]),
    )
    assert [s.url for s in trusted] == [f"s3://{BUCKET}/nested/x.tar"]
    with pytest.raises(UserError, match="s3://just-a-bucket: need s3://BUCKET/KEY or gs://BUCKET/KEY"):
        shardspec.expand("s3://just-a-bucket")
    assert s3open.join(f"s3://{BUCKET}/a/i.json", "../../x.tar") is None  # above the bucket's root
    assert s3open.join(f"s3://{BUCKET}/i.json", "./x.tar") == f"s3://{BUCKET}/x.tar"


def test_an_oversized_index_in_a_bucket_is_refused(store, monkeypatch):
    monkeypatch.setattr(shardspec, "MAX_INDEX_BYTES", 100)  # val.index.json is ~400 bytes
    with pytest.raises(
        UserError, match=rf"cannot read shard index {VAL_INDEX}: it is more than the limit of 100 bytes"
    ):
        shardspec.expand(VAL_INDEX, access=shardspec.Access(s3_endpoint_url=store["endpoint"]))


def test_boto3_is_imported_only_for_object_store_urls(tiny_shards):
    # run_script's process is forked from a Python that imported neither (tests/preloaded.py)
    index = tiny_shards([3])
    code = (
        "import sys; from wdsdist.data.sources import shardspec; from wdsdist.data.tar import tarread; "
        f"shardspec.expand({str(index)!r}); print('boto3' in sys.modules, 'botocore' in sys.modules)"
    )
    out = run_script("-c", code, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_predict_scores_an_s3_index_once_on_two_ranks_through_the_node_cache(store, tmp_path):
    """predict.py --out-dir: every key once, in order; each object fetched once (then the node
    cache), though --write-shards reads every shard again."""
    from tests.helpers.predicting import jsonl, model_folder

    del store["app"].log[:]
    env = {"AWS_ENDPOINT_URL": store["endpoint"], "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    model, out, t = str(model_folder(tmp_path / "model")), str(tmp_path / "out"), str(tmp_path)
    args = (model, VAL_INDEX, "--out-dir", out, "--workers", "1", "--out", f"{t}/all.jsonl", "--write-shards", t)
    assert run_script("predict.py", *args, "--cache-dir", f"{t}/cache", env=env, ranks=2).returncode == 0
    rows = [r["image"].rsplit("/", 1)[1] for r in jsonl(tmp_path / "all.jsonl")]
    want = [f"val-{i:06d}.tar#s{sum(VAL_COUNTS[:i]) + n:07d}" for i, c in enumerate(VAL_COUNTS) for n in range(c)]
    gets = sorted(p for _, p in store["app"].gets())
    assert rows == want and gets == [f"/{BUCKET}/val/val-{i:06d}.tar" for i in range(3)]
    index = json.loads((tmp_path / "predicted.index.json").read_text())
    assert [s["nsamples"] for s in index["shardlist"]] == VAL_COUNTS
