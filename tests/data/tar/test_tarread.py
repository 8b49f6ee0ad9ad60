"""The fast tar reader gives exactly WebDataset's samples, in every tar format, and fails as tarfile does."""

import bz2
import gzip
import io
import lzma
import tarfile

import pytest
from webdataset.tariterators import group_by_keys, tar_file_expander

from tests.helpers.shards import pax_record, raw_member
from wdsdist.data.tar.tarread import Oversized, tar_samples

LONG = "d" * 60 + "/" + "e" * 70  # over ustar's 100-character name field


def make_tar(fmt: int, members: list[tuple[str, bytes | None]]) -> bytes:
    """Members in order; data None makes a directory, b"->" a symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif data == b"->":
                info.type, info.linkname = tarfile.SYMTYPE, "elsewhere"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


MEMBERS = [
    ("a/", None),
    ("a/s1.jpg", b"J" * 1000),
    ("a/s1.cls", b"3"),
    ("a/s1.json", b"{}" * 40_000),  # large and unwanted: skipped by seeking
    ("__meta__", b"skip me"),
    ("a/s2.seg.PNG", b"P" * 513),
    ("a/s2.cls", b"4"),
    ("a/link.jpg", b"->"),
    (f"{LONG}/s3.jpg", b"L" * 512),
    (f"{LONG}/s3.cls", b"5"),
    ("noext", b"x"),
]


def reference(raw: bytes) -> list[dict]:
    return list(group_by_keys(tar_file_expander([{"url": "u", "stream": io.BytesIO(raw)}], eof_value=None)))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_same_samples_as_webdataset(fmt):
    members = MEMBERS if fmt != tarfile.USTAR_FORMAT else [m for m in MEMBERS if LONG not in m[0]]
    if fmt == tarfile.USTAR_FORMAT:  # ustar splits long paths into prefix + name
        members += [("p" * 120 + "/s4.jpg", b"U" * 10), ("p" * 120 + "/s4.cls", b"6")]
    raw = make_tar(fmt, members)
    ours = list(tar_samples(io.BytesIO(raw), "u"))
    assert ours == reference(raw)
    last = "s4" if fmt == tarfile.USTAR_FORMAT else "s3"
    assert [s["__key__"].rsplit("/", 1)[-1] for s in ours] == ["s1", "s2", last]
    assert ours[0]["json"] == b"{}" * 40_000 and ours[1]["seg.png"] == b"P" * 513


def test_unwanted_members_are_listed_but_not_read():
    raw = make_tar(tarfile.PAX_FORMAT, MEMBERS)
    ours = list(tar_samples(io.BytesIO(raw), "u", frozenset({"jpg", "cls"})))
    assert ours[0]["jpg"] == b"J" * 1000 and ours[0]["cls"] == b"3"
    assert "json" in ours[0] and ours[0]["json"] is None
    assert ours[1]["seg.png"] is None and ours[1]["cls"] == b"4"
    assert ours[2]["jpg"] == b"L" * 512


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress])
def test_compressed_shards_read_the_same(compress):
    raw = make_tar(tarfile.GNU_FORMAT, MEMBERS)
    assert list(tar_samples(io.BytesIO(compress(raw)), "u")) == reference(raw)


class Trickle(io.RawIOBase):
    """A pipe-like stream that returns at most 100 bytes per read."""

    def __init__(self, data: bytes):
        self.data = io.BytesIO(data)

    def readable(self):
        return True

    def read(self, n=-1):
        return self.data.read(min(n, 100) if n and n > 0 else 100)


def test_short_reads_are_completed():
    raw = make_tar(tarfile.PAX_FORMAT, MEMBERS)
    assert list(tar_samples(Trickle(raw), "u")) == reference(raw)


def test_truncated_and_garbage_raise_tarfiles_errors():
    raw = make_tar(tarfile.GNU_FORMAT, MEMBERS)
    cut = raw.index(b"J" * 1000) + 500  # in the middle of the first image
    samples = tar_samples(io.BytesIO(raw[:cut]), "u")
    with pytest.raises(tarfile.ReadError, match="unexpected end of data"):
        list(samples)
    with pytest.raises(tarfile.ReadError, match="invalid header"):
        list(tar_samples(io.BytesIO(b"\x00garbage" * 100), "u"))
    damaged = bytearray(raw)
    second = raw.index(b"a/s1.cls")  # a later header whose checksum no longer holds
    damaged[second] = ord("b")
    with pytest.raises(tarfile.ReadError, match="invalid header"):
        list(tar_samples(io.BytesIO(bytes(damaged)), "u"))
    with pytest.raises(tarfile.ReadError, match="empty file"):  # as before: an empty shard is an error
        list(tar_samples(io.BytesIO(b""), "u"))


def test_duplicate_member_is_an_error():
    raw = make_tar(tarfile.GNU_FORMAT, [("k.jpg", b"1"), ("k.cls", b"1"), ("k.jpg", b"2")])
    with pytest.raises(ValueError, match="k.jpg: duplicate file name"):
        list(tar_samples(io.BytesIO(raw), "u"))


def test_bad_pax_records_and_sparse_members_fail_instead_of_hanging():
    raw = make_tar(tarfile.PAX_FORMAT, [(LONG + "/k.jpg", b"x"), (LONG + "/k.cls", b"1")])
    records = raw.index(b" path=")
    length = raw[records - 3 : records]  # the record's length digits, e.g. b"150"
    zero = raw[: records - 3] + b"0".rjust(len(length), b"0") + raw[records:]
    with pytest.raises(tarfile.ReadError, match="invalid pax header"):
        list(tar_samples(io.BytesIO(zero), "u"))  # a zero length must not loop forever
    sparse = make_tar(tarfile.GNU_FORMAT, [("s.jpg", b"x")])
    sparse = bytearray(sparse)
    sparse[156] = ord("S")
    chk = sum(sparse[:148]) + 256 + sum(sparse[156:512])
    sparse[148:156] = b"%06o\0 " % chk
    with pytest.raises(tarfile.ReadError, match="GNU sparse members are not supported"):
        list(tar_samples(io.BytesIO(bytes(sparse)), "u"))


def test_a_signed_checksum_is_accepted_as_tarfile_does():
    raw = bytearray(make_tar(tarfile.GNU_FORMAT, [("x.jpg", b"x"), ("y.cls", b"1")]))
    second = raw.index(b"y.cls")
    raw[second + 100] = 0xE9  # a high byte in the mode field: the signed and unsigned sums differ
    header = raw[second : second + 512]
    signed = sum(b - 256 if b > 127 else b for b in header[:148] + header[156:]) + 256
    raw[second + 148 : second + 156] = b"%06o\0 " % signed
    assert [s["__key__"] for s in tar_samples(io.BytesIO(bytes(raw)), "u")] == ["x", "y"]


# ---------------------------------------------------------------- sizes from untrusted headers


def test_a_negative_pax_size_fails_the_shard_instead_of_reading_the_stream_to_its_end():
    good = raw_member("a.jpg", b"J") + raw_member("a.cls", b"1") + raw_member("b.jpg", b"K")
    evil = raw_member("././@PaxHeader", pax_record("size", "-1"), tarfile.XHDTYPE) + raw_member("b.cls", b"")
    stream = Trickle(good + evil + raw_member("c.jpg", b"x" * 5000) + b"\0" * 1024)
    samples = tar_samples(stream, "u")
    assert next(samples) == {"__key__": "a", "__url__": "u", "jpg": b"J", "cls": b"1"}
    with pytest.raises(tarfile.ReadError, match="b.cls: negative size -1"):
        next(samples)
    assert stream.data.tell() < len(good) + len(evil) + 512  # it stopped there
    garbled = raw_member("././@PaxHeader", pax_record("size", "12x"), tarfile.XHDTYPE) + raw_member("b.jpg", b"")
    with pytest.raises(tarfile.ReadError, match="b.jpg: invalid size '12x'"):
        list(tar_samples(io.BytesIO(garbled), "u"))


def test_a_negative_base256_size_fails_the_shard():
    raw = bytearray(make_tar(tarfile.GNU_FORMAT, [("x.jpg", b"x"), ("x.cls", b"1")]))
    raw[124:136] = b"\xff" * 12  # base-256 for -1, as tarfile reads it
    raw[148:156] = b"%06o\0 " % (sum(raw[:148]) + 256 + sum(raw[156:512]))
    with pytest.raises(tarfile.ReadError, match="negative size -1"):
        list(tar_samples(io.BytesIO(bytes(raw)), "u"))


class Recording(Trickle):
    """A pipe-like stream that remembers the largest read asked of it."""

    largest = 0

    def read(self, n=-1):
        self.largest = max(self.largest, n if n >= 0 else 1 << 62)
        return self.data.read(n)


BIG = 3 << 20
OVERSIZED = [("k1.jpg", b"B" * BIG), ("k1.cls", b"1"), ("k2.jpg", b"J"), ("k2.cls", b"2"), ("k3.jpg", b"K")]
OVERSIZED += [("k3.cls", b"3")]


def test_a_member_over_the_limit_is_skipped_unread_and_the_next_samples_follow():
    raw = make_tar(tarfile.GNU_FORMAT, OVERSIZED)
    stream = Recording(raw)
    samples = list(tar_samples(stream, "u", frozenset({"jpg", "cls"}), max_member=1 << 20))
    assert [s["__key__"] for s in samples] == ["k1", "k2", "k3"]
    assert samples[0]["jpg"] == Oversized(BIG) and samples[0]["cls"] == b"1"
    assert samples[1]["jpg"] == b"J" and samples[2]["cls"] == b"3"
    assert stream.largest <= 1 << 20  # dropped a chunk at a time, never read whole
    # Within the limit, or without one, it is read as before.
    assert list(tar_samples(io.BytesIO(raw), "u", max_member=BIG))[0]["jpg"] == b"B" * BIG


def test_a_compressed_member_over_the_limit_is_skipped_too():
    raw = make_tar(tarfile.GNU_FORMAT, OVERSIZED)
    samples = list(tar_samples(io.BytesIO(gzip.compress(raw)), "u", max_member=1 << 20))
    assert [s["__key__"] for s in samples] == ["k1", "k2", "k3"]
    assert samples[0]["jpg"] == Oversized(BIG) and samples[1]["jpg"] == b"J"


def test_an_extended_header_over_the_limit_fails_the_shard():
    raw = raw_member("././@PaxHeader", pax_record("comment", "c" * 5000), tarfile.XHDTYPE) + raw_member("b.jpg", b"")
    with pytest.raises(tarfile.ReadError, match="extended header of 5014 bytes exceeds max_member_bytes=4096"):
        list(tar_samples(io.BytesIO(raw), "u", max_member=4096))
