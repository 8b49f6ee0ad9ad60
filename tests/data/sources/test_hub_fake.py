"""The fake Hub (tests/helpers/hub.py) answers huggingface_hub's own client as huggingface.co does: the hf://
tests are only as good as this fake, so it is checked here through the client, not through its internals."""

from __future__ import annotations

import hashlib
import http.client
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

huggingface_hub = pytest.importorskip("huggingface_hub")

from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url  # noqa: E402
from huggingface_hub import constants as hf_constants  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import _http as hf_http  # noqa: E402

from tests.conftest import ROOT  # noqa: E402
from tests.helpers.hub import Hub, is_lfs  # noqa: E402

REPO = "org/shards"
SHARDS = {f"train/train-{i:04d}.tar": bytes([i]) * (3000 + i) for i in range(6)}
FILES = {**SHARDS, "_info.json": b'{"splits": ["train"]}'}
TOKEN = "hf_reader"


@pytest.fixture(autouse=True)
def _hf_env(monkeypatch, tmp_path):
    """No cache, token or offline switch of the machine's: huggingface_hub read its env at import."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub():
    with Hub(page_size=3) as hub:
        hub.add_repo(REPO, FILES)
        yield hub


def url(hub: Hub, filename: str, revision: str | None = None, repo: str = REPO) -> str:
    return hf_hub_url(repo, filename, repo_type="dataset", revision=revision, endpoint=hub.endpoint)


def metadata(hub: Hub, filename: str, revision: str | None = None, token: str | bool = False, repo: str = REPO):
    return get_hf_file_metadata(url(hub, filename, revision, repo), token=token, endpoint=hub.endpoint)


def download(hub: Hub, tmp_path, filename: str, revision: str | None = None, token: str | bool = False) -> bytes:
    path = hf_hub_download(
        REPO, filename, repo_type="dataset", revision=revision, endpoint=hub.endpoint, token=token, cache_dir=tmp_path
    )
    with open(path, "rb") as f:
        return f.read()


def test_dataset_info_follows_the_branch_and_old_commits_stay_readable(hub, tmp_path):
    api = HfApi(endpoint=hub.endpoint, token=False)
    first = api.dataset_info(REPO).sha
    assert api.dataset_info(REPO, revision="main").sha == first
    assert sorted(s.rfilename for s in api.dataset_info(REPO).siblings) == sorted(FILES)
    second = hub.commit(REPO, {"train/train-0000.tar": b"new" * 1000}, delete=["_info.json"])
    assert len(second) == 40 and second != first
    assert api.dataset_info(REPO).sha == second
    assert api.dataset_info(REPO, revision=first).sha == first
    assert "_info.json" not in {s.rfilename for s in api.dataset_info(REPO).siblings}
    assert download(hub, tmp_path, "train/train-0000.tar", revision=first) == FILES["train/train-0000.tar"]
    assert download(hub, tmp_path, "train/train-0000.tar") == b"new" * 1000
    hub.branch(REPO, "refs/pr/1", first)
    assert api.dataset_info(REPO, revision="refs/pr/1").sha == first
    assert metadata(hub, "_info.json", revision="refs/pr/1").commit_hash == first


def test_dataset_info_files_metadata_gives_sizes_and_lfs(hub):
    info = HfApi(endpoint=hub.endpoint, token=False).dataset_info(REPO, files_metadata=True)
    by_name = {s.rfilename: s for s in info.siblings}
    tar = by_name["train/train-0001.tar"]
    assert tar.size == 3001 and tar.lfs.sha256 == hashlib.sha256(FILES["train/train-0001.tar"]).hexdigest()
    assert by_name["_info.json"].lfs is None and by_name["_info.json"].size == len(FILES["_info.json"])


def test_list_repo_tree_follows_the_pages(hub):
    api = HfApi(endpoint=hub.endpoint, token=False)
    hub.reset_counts()
    entries = list(api.list_repo_tree(REPO, repo_type="dataset", recursive=True))
    assert hub.api_requests[REPO] == 3  # 8 entries (7 files and train/) at 3 a page
    assert sorted(e.path for e in entries) == sorted([*FILES, "train"])
    files = {e.path: e for e in entries if type(e).__name__ == "RepoFile"}
    assert set(files) == set(FILES)
    assert files["train/train-0002.tar"].size == 3002
    assert files["train/train-0002.tar"].lfs.sha256 == hashlib.sha256(FILES["train/train-0002.tar"]).hexdigest()
    assert files["_info.json"].lfs is None
    top = list(api.list_repo_tree(REPO, repo_type="dataset"))
    assert sorted(e.path for e in top) == ["_info.json", "train"]
    under = list(api.list_repo_tree(REPO, "train", repo_type="dataset", revision=api.dataset_info(REPO).sha))
    assert sorted(e.path for e in under) == sorted(SHARDS)
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, "valid", repo_type="dataset"))


def test_file_metadata_for_lfs_and_small_files(hub):
    sha = HfApi(endpoint=hub.endpoint, token=False).dataset_info(REPO).sha
    tar = metadata(hub, "train/train-0003.tar")
    assert is_lfs("train/train-0003.tar", FILES["train/train-0003.tar"])
    assert tar.commit_hash == sha and tar.size == 3003
    assert tar.etag == hashlib.sha256(FILES["train/train-0003.tar"]).hexdigest()
    assert tar.location.startswith(hub.cdn + "/blobs/" + tar.etag + "?expires=")
    small = metadata(hub, "_info.json", revision=sha)
    assert small.commit_hash == sha and small.size == len(FILES["_info.json"])
    assert small.location == url(hub, "_info.json", sha)  # answered by the Hub itself: no redirect
    assert len(small.etag) == 40
    assert hub.resolves[f"{REPO}/train/train-0003.tar"] == 1 and not hub.cdn_requests


def test_hf_hub_download_of_a_gated_repo_keeps_the_token_off_the_cdn(hub, tmp_path):
    hub.add_repo("org/gated", FILES, gated=True)
    hub.grant(TOKEN, "org/gated")
    path = hf_hub_download(
        "org/gated", "train/train-0004.tar", repo_type="dataset", endpoint=hub.endpoint, token=TOKEN, cache_dir=tmp_path
    )
    with open(path, "rb") as f:
        assert f.read() == FILES["train/train-0004.tar"]
    assert hub.cdn_bytes["org/gated/train/train-0004.tar"] == 3004
    assert hub.cdn_requests["org/gated/train/train-0004.tar"] == 1
    assert hub.cdn_authorization == []
    assert download(hub, tmp_path, "_info.json") == FILES["_info.json"]


def test_the_cdn_records_a_token_that_urllib_carries_across_the_redirect(hub):
    """urllib sends add_header()'s headers on to a redirect's other host; add_unredirected_header()'s it does not."""
    leaky = urllib.request.Request(url(hub, "train/train-0000.tar"))
    leaky.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(leaky) as r:
        assert r.read() == FILES["train/train-0000.tar"]
    assert hub.cdn_authorization == [f"Bearer {TOKEN}"]
    hub.reset_counts()
    safe = urllib.request.Request(url(hub, "train/train-0000.tar"))
    safe.add_unredirected_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(safe) as r:
        assert r.read() == FILES["train/train-0000.tar"]
    assert hub.cdn_authorization == []


@pytest.mark.parametrize(
    ("repo", "filename", "revision", "token", "error", "status"),
    [
        ("org/gated", "_info.json", None, False, GatedRepoError, 401),
        ("org/gated", "train/train-0000.tar", None, "hf_other", GatedRepoError, 403),
        ("org/nope", "_info.json", None, False, RepositoryNotFoundError, 401),
        ("org/nope", "_info.json", None, TOKEN, RepositoryNotFoundError, 404),
        ("org/private", "_info.json", None, "hf_other", RepositoryNotFoundError, 404),
        (REPO, "_info.json", "nope", False, RevisionNotFoundError, 404),
        (REPO, "_info.json", "0" * 40, False, RevisionNotFoundError, 404),
        (REPO, "valid/valid-0000.tar", None, False, EntryNotFoundError, 404),
    ],
)
def test_errors_are_huggingface_hubs_own(hub, repo, filename, revision, token, error, status):
    hub.add_repo("org/gated", FILES, gated=True)
    hub.add_repo("org/private", FILES, private=True)
    with pytest.raises(error) as caught:
        metadata(hub, filename, revision, token, repo=repo)
    assert type(caught.value) is error or issubclass(type(caught.value), error) and error is EntryNotFoundError
    assert caught.value.response.status_code == status


def test_info_and_tree_of_a_gated_repo_are_open_its_files_are_not(hub):
    hub.add_repo("org/gated", FILES, gated=True)
    api = HfApi(endpoint=hub.endpoint, token=False)
    assert api.dataset_info("org/gated").gated == "auto"
    assert len(list(api.list_repo_tree("org/gated", repo_type="dataset", recursive=True))) == 8
    with pytest.raises(RevisionNotFoundError):
        api.dataset_info(REPO, revision="nope")
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.endpoint, token=TOKEN).dataset_info("org/nope")


def test_a_429_carries_retry_after_and_the_ratelimit_headers(hub, monkeypatch):
    hub.rate_limit(1, retry_after=7)
    with pytest.raises(HfHubHTTPError) as caught:
        metadata(hub, "_info.json")  # get_hf_file_metadata: no retries unless retry_on_errors=True
    response = caught.value.response
    assert response.status_code == 429 and response.headers["Retry-After"] == "7"
    info = hf_http.parse_ratelimit_headers(response.headers)
    assert (info.resource_type, info.remaining, info.reset_in_seconds) == ("resolvers", 0, 7)
    assert "Retry after 7 seconds" in str(caught.value)
    assert metadata(hub, "_info.json").size == len(FILES["_info.json"])  # only the next one was limited

    waits: list[float] = []

    class Clock:  # huggingface_hub's backoff waits on time.sleep: record the wait instead
        sleep = staticmethod(waits.append)

        def __getattr__(self, name: str):
            return getattr(time, name)

    monkeypatch.setattr(hf_http, "time", Clock())
    hub.rate_limit(1, retry_after=3)
    entries = list(HfApi(endpoint=hub.endpoint, token=False).list_repo_tree(REPO, repo_type="dataset"))
    assert len(entries) == 2 and waits == [4.0]  # the tree listing retries, after RateLimit's t + 1 s
    assert hub.rate_limited == 2


def test_a_ranged_get_on_the_signed_location(hub):
    data = FILES["train/train-0005.tar"]
    location = metadata(hub, "train/train-0005.tar", token=TOKEN).location
    request = urllib.request.Request(location, headers={"Range": "bytes=100-199"})
    with urllib.request.urlopen(request) as r:
        assert r.status == 206 and r.headers["Content-Range"] == f"bytes 100-199/{len(data)}"
        assert r.read() == data[100:200]
    with urllib.request.urlopen(urllib.request.Request(location, headers={"Range": "bytes=3000-"})) as r:
        assert r.read() == data[3000:]
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(urllib.request.Request(location, headers={"Range": f"bytes={len(data)}-"}))
    assert caught.value.code == 416
    assert hub.cdn_bytes[f"{REPO}/train/train-0005.tar"] == 100 + len(data) - 3000
    assert hub.cdn_requests[f"{REPO}/train/train-0005.tar"] == 3
    assert hub.cdn_authorization == []


def test_signed_urls_expire(hub):
    hub.url_uses = 1
    location = metadata(hub, "train/train-0000.tar").location
    with urllib.request.urlopen(location) as r:
        assert r.read() == FILES["train/train-0000.tar"]
    for forged in (location, location.replace("sig=", "sig=0"), location.replace("expires=", "expires=9")):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(forged)
        assert caught.value.code == 403
        body = caught.value.read().decode()
        assert "<Code>AccessDenied</Code>" in body
        assert ("Request has expired" in body) == (forged == location)
    hub.url_uses = None
    fresh = metadata(hub, "train/train-0000.tar").location
    assert fresh != location
    with urllib.request.urlopen(fresh) as r:
        assert r.status == 200
    hub.expire_urls()
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(fresh)
    assert caught.value.code == 403


def test_cut_after_drops_the_connection_and_a_range_resumes(hub):
    data = FILES["train/train-0002.tar"]
    location = metadata(hub, "train/train-0002.tar").location
    hub.cut_after(1000)
    with urllib.request.urlopen(location) as r:
        assert r.headers["Content-Length"] == str(len(data))
        with pytest.raises(http.client.IncompleteRead) as caught:
            r.read()
    assert caught.value.partial == data[:1000]
    assert hub.cdn_bytes[f"{REPO}/train/train-0002.tar"] == 1000
    with urllib.request.urlopen(urllib.request.Request(location, headers={"Range": "bytes=1000-"})) as r:
        assert r.status == 206 and r.read() == data[1000:]
    assert hub.cdn_bytes[f"{REPO}/train/train-0002.tar"] == len(data)
    assert hub.cdn_requests[f"{REPO}/train/train-0002.tar"] == 2


def test_runs_as_a_script(tmp_path):
    for name, data in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    command = [sys.executable, "-m", "tests.helpers.hub", "--repo", f"timm/tiny={tmp_path}", "--gated"]
    proc = subprocess.Popen([*command, "--token", TOKEN], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("HF_ENDPOINT=http://127.0.0.1:")
        endpoint = line.partition("=")[2]
        assert HfApi(endpoint=endpoint, token=False).dataset_info("timm/tiny").gated == "auto"
        tar = hf_hub_url("timm/tiny", "train/train-0001.tar", repo_type="dataset", endpoint=endpoint)
        assert get_hf_file_metadata(tar, token=TOKEN, endpoint=endpoint).size == 3001
        with pytest.raises(GatedRepoError):
            get_hf_file_metadata(tar, token=False, endpoint=endpoint)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
