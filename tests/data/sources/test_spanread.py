"""read_span: a shard's samples start .. stop - 1 exactly as islice(tar_samples) gives them, from
local files (seeking), gzip (read and drop), and http with and without the index's byte offsets
(Range requests, and servers that ignore them); and what it does not read."""

from __future__ import annotations

import functools
import gzip
import http.server
import io
import itertools
import tarfile
import threading
from pathlib import Path

import pytest

from tests.helpers.loading import Quiet
from wdsdist.data.sources.index import offsets_entry
from wdsdist.data.sources.opener import Access
from wdsdist.data.sources.schemes import file as local_files
from wdsdist.data.sources.shardspec import SampleOffsets, Shard, _offsets
from wdsdist.data.sources.spanread import read_span
from wdsdist.data.tar.lateread import Late, read_late
from wdsdist.data.tar.tarread import Oversized, sample_offsets, tar_samples

ACCESS = Access(http_timeout=10)
BIG = 70_000  # above tarread's 64 KiB seek threshold


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1
    tar.addfile(info, io.BytesIO(data))


def odd_tar(n: int = 11) -> bytes:
    """A shard with what a reader must step over: PAX (long) names, a directory, a meta member,
    a member above the seek threshold, and samples of one to three members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "__meta__/info.json", b"{}")  # skipped by the reader, before sample 0
        for i in range(n):
            key = f"s{i:03d}" if i % 4 else f"{'long/' * 25}s{i:03d}"  # > 100 chars: a PAX header
            _add(tar, f"{key}.jpg", bytes([i]) * (BIG if i % 3 == 0 else 300 + i))
            if i % 2:
                _add(tar, f"{key}.cls", str(i).encode())
            if i % 5 == 1:
                _add(tar, f"{key}.json", b"{}" * 600)
            if i == 6:
                info = tarfile.TarInfo("adir")
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
    return buf.getvalue()


N = 11


def table(raw: bytes, every: int) -> SampleOffsets:
    entry = offsets_entry(sample_offsets(io.BytesIO(raw)), every)
    return _offsets("test", entry, N)


def reference(raw: bytes, url: str, wanted=None, max_member=None) -> list[dict]:
    return list(tar_samples(io.BytesIO(raw), url, wanted, max_member))


def spans(n: int, every_stop: bool = True):
    for start in range(n + 2):
        stops = range(start, n + 3) if every_stop else sorted({start, start + 1, start + 3, n, n + 2})
        for stop in [*stops, None]:
            yield start, stop


class _Ranged(Quiet):
    """Serves its folder with Range support (206), logging each request's path and Range."""

    log: list[tuple[str, str | None]]
    honour_range = True

    def do_GET(self):
        self.log.append((self.path, self.headers.get("Range")))
        path = Path(self.directory) / self.path.lstrip("/")
        want = self.headers.get("Range")
        if not (self.honour_range and want and path.is_file()):
            return super().do_GET()
        data = path.read_bytes()
        first, _, last = want.removeprefix("bytes=").partition("-")
        first, last = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.send_header("Content-Length", str(last - first + 1))
        self.end_headers()
        try:
            self.wfile.write(data[first : last + 1])
        except OSError:
            pass  # the client hung up after the part it needed


@pytest.fixture
def shard_files(tmp_path):
    raw = odd_tar(N)
    (tmp_path / "odd.tar").write_bytes(raw)
    (tmp_path / "odd.tar.gz").write_bytes(gzip.compress(raw))
    return raw, tmp_path


def serve(folder: Path, honour_range: bool):
    log: list[tuple[str, str | None]] = []
    handler = type("Handler", (_Ranged,), {"log": log, "honour_range": honour_range})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", log


@pytest.mark.parametrize("every", [None, 1, 3])
@pytest.mark.parametrize("wanted", [None, frozenset({"jpg", "json"})])
@pytest.mark.parametrize("late", [False, True])
def test_a_local_span_is_what_islice_gives_for_every_start_and_stop(shard_files, every, wanted, late):
    raw, folder = shard_files
    url = str(folder / "odd.tar")
    shard = Shard(url, N, table(raw, every) if every else None)
    ref = reference(raw, url, wanted)
    for start, stop in spans(N):
        got = list(read_span(shard, start, stop, ACCESS, wanted, late=late))
        # late: the BIG members come as lateread.Late, read after the span's file is closed
        big = any(i % 3 == 0 for i in range(start, min(N, N if stop is None else stop)))
        assert any(isinstance(v, Late) for s in got for v in s.values()) == (late and big)
        assert [read_late(s) for s in got] == ref[start:stop], (start, stop)


def test_a_gzipped_span_is_read_and_dropped_to_the_same_samples(shard_files):
    raw, folder = shard_files
    url = str(folder / "odd.tar.gz")
    ref = reference(raw, url)
    for start, stop in spans(N):
        assert list(read_span(Shard(url, N), start, stop, ACCESS)) == ref[start:stop], (start, stop)


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "range-ignored"])
@pytest.mark.parametrize("every", [None, 1, 4])
def test_an_http_span_is_what_islice_gives_and_asks_for_a_range_only_with_offsets(shard_files, every, honour_range):
    raw, folder = shard_files
    server, base, log = serve(folder, honour_range)
    try:
        url = f"{base}/odd.tar"
        shard = Shard(url, N, table(raw, every) if every else None)
        ref = reference(raw, url)
        for start, stop in spans(N, every_stop=False):
            assert list(read_span(shard, start, stop, ACCESS)) == ref[start:stop], (start, stop)
    finally:
        server.shutdown()
        server.server_close()
    ranges = [r for _, r in log if r is not None]
    if every is None:
        assert ranges == []  # no offsets: the shard is read from its start
    else:
        offsets = sample_offsets(io.BytesIO(raw))
        assert f"bytes={offsets[4 if every == 4 else 5]}-" in {r.partition("-")[0] + "-" for r in ranges}
        # the span 0 .. 2 asks for nothing after the table's first offset at or after sample 3
        assert f"bytes=0-{offsets[3 if every == 1 else 4] - 1}" in ranges


def test_oversized_members_are_placeholders_inside_the_span_and_unread_before_it(shard_files):
    raw, folder = shard_files
    url = str(folder / "odd.tar")
    ref = reference(raw, url, max_member=BIG - 1)
    assert any(isinstance(v, Oversized) for s in ref for v in s.values())
    for every in (None, 2):
        shard = Shard(url, N, table(raw, every) if every else None)
        for start, stop in [(0, N), (2, 7), (3, 4), (9, None)]:
            assert list(read_span(shard, start, stop, ACCESS, max_member=BIG - 1)) == ref[start:stop]


class _Counting(io.RawIOBase):
    """A local file that counts the bytes read from it (seeks cost nothing)."""

    def __init__(self, path: str, counter: list[int]) -> None:
        self._file, self._counter = io.FileIO(path), counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._file.readinto(buffer)
        self._counter[0] += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
        super().close()


def big_shard(path: Path, n: int, size: int) -> None:
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            _add(tar, f"k{i:03d}.jpg", bytes([i]) * size)
            _add(tar, f"k{i:03d}.cls", b"1")


@pytest.mark.parametrize("with_offsets", [False, True])
def test_a_local_span_reads_no_byte_of_the_samples_before_or_after_it(tmp_path, monkeypatch, with_offsets):
    size, n = 1 << 20, 10
    path = tmp_path / "big.tar"
    big_shard(path, n, size)
    counter = [0]

    def counting_open(name, mode="r", buffering=-1):
        return io.BufferedReader(_Counting(str(name), counter))

    monkeypatch.setattr(local_files, "open", counting_open, raising=False)
    offsets = (
        _offsets("t", offsets_entry(sample_offsets(io.BytesIO(path.read_bytes())), 3), n) if with_offsets else None
    )
    shard = Shard(str(path), n, offsets)
    samples = list(read_span(shard, 7, 8, ACCESS))
    assert [s["__key__"] for s in samples] == ["k007"] and samples[0]["jpg"] == bytes([7]) * size
    # One sample's megabyte plus a buffer's fill for each header read (2 members a sample), not
    # the 7 MB before it or the 2 MB after it.
    assert size <= counter[0] <= size + 2 * (n - 1) * io.DEFAULT_BUFFER_SIZE, counter[0]
    counter[0] = 0
    assert len(list(itertools.islice(tar_samples(counting_open(path), str(path)), 7, 8))) == 1
    assert counter[0] >= 8 * size  # what reading and dropping costs, for comparison


def test_a_stale_offset_fails_the_shard_naming_the_byte_and_the_index(shard_files):
    raw, folder = shard_files
    url = str(folder / "odd.tar")
    good = sample_offsets(io.BytesIO(raw))
    shifted = [good[0]] + [o + 512 for o in good[1:]]  # well-formed, but not where samples begin
    shard = Shard(url, N, _offsets("t", offsets_entry(shifted, 1), N))
    with pytest.raises(tarfile.ReadError, match=rf"byte {shifted[5]} where the index puts sample 5 .*stale index"):
        list(read_span(shard, 5, 6, ACCESS))


def test_an_http_span_cut_short_by_a_wrong_end_offset_fails_instead_of_losing_samples(shard_files):
    raw, folder = shard_files
    good = sample_offsets(io.BytesIO(raw))
    wrong = good[:4] + [good[3]] + good[5:]  # sample 4 "begins" where sample 3 does
    shard_table = SampleOffsets(1, b"".join(o.to_bytes(8, "little") for o in wrong))
    server, base, log = serve(folder, True)
    try:
        with pytest.raises(tarfile.ReadError, match=r"held only 3 of samples 0 \.\. 3 .*stale index"):
            list(read_span(Shard(f"{base}/odd.tar", N, shard_table), 0, 4, ACCESS))
    finally:
        server.shutdown()
        server.server_close()
    assert log == [("/odd.tar", f"bytes=0-{good[3] - 1}")]


class _WrongPart(Quiet):
    """Answers a Range request with another part than the one asked for."""

    def do_GET(self):
        data = (Path(self.directory) / self.path.lstrip("/")).read_bytes()
        self.send_response(206)
        self.send_header("Content-Range", f"bytes 0-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_server_sending_another_part_than_asked_fails_naming_it(shard_files):
    raw, folder = shard_files
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_WrongPart, directory=str(folder)))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/odd.tar"
        with pytest.raises(OSError, match=r"asked for bytes from \d+, the server sent Content-Range 'bytes 0-"):
            list(read_span(Shard(url, N, table(raw, 1)), 5, 6, ACCESS))
    finally:
        server.shutdown()
        server.server_close()


def test_a_range_request_keeps_its_range_through_a_redirect(shard_files):
    raw, folder = shard_files
    server, base, log = serve(folder, True)
    try:
        redirect = type("Redirect", (_Ranged,), {"log": log})

        def do_get(self):
            self.log.append((self.path, self.headers.get("Range")))
            self.send_response(302)
            self.send_header("Location", f"{base}/odd.tar")
            self.send_header("Content-Length", "0")
            self.end_headers()

        redirect.do_GET = do_get
        front = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(redirect, directory=str(folder)))
        threading.Thread(target=front.serve_forever, args=(0.05,), daemon=True).start()
        try:
            url = f"http://127.0.0.1:{front.server_address[1]}/moved.tar"
            shard = Shard(url, N, table(raw, 1))
            assert list(read_span(shard, 5, 7, ACCESS)) == reference(raw, url)[5:7]
        finally:
            front.shutdown()
            front.server_close()
    finally:
        server.shutdown()
        server.server_close()
    offsets = sample_offsets(io.BytesIO(raw))
    asked = f"bytes={offsets[5]}-{offsets[7] - 1}"
    assert log == [("/moved.tar", asked), ("/odd.tar", asked)]
