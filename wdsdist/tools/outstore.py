"""Where a conversion's shards, plan, records and index go: a local folder, or an s3:// or gs://
prefix. Shards are written in a local folder first (the output folder itself, or a temporary one
for a bucket) and published whole: a rename there, an upload here (one PUT: an object appears
whole or not at all). Small files (plan, records, index) are written whole in both."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from wdsdist.data.sources import s3open
from wdsdist.errors import UserError
from wdsdist.tools.outfolder import make_output_folder, written_whole

TIMEOUT = 120.0
MAX_SMALL = 1 << 30  # a plan of ImageNet is ~80 MB; anything larger is not ours


class LocalStore:
    def __init__(self, folder: str):
        make_output_folder(folder, f"--shards {folder}")
        self.where = folder
        self.staging = folder  # shards are written here, then renamed into place

    def path(self, name: str) -> str:
        return os.path.join(self.where, name)

    def read(self, name: str) -> bytes | None:
        try:
            with open(self.path(name), "rb") as f:
                return f.read(MAX_SMALL)
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
        with written_whole(self.path(name)) as tmp, open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def size(self, name: str) -> int | None:
        try:
            return os.path.getsize(self.path(name))
        except FileNotFoundError:
            return None

    def publish(self, name: str) -> None:
        """The shard is in place already (written_shard renamed it)."""

    def remove_tree(self, name: str) -> None:
        shutil.rmtree(self.path(name), ignore_errors=True)

    def close(self) -> None:
        pass


class ObjectStore:
    """s3:// or gs://: boto3 (the [s3] extra), the endpoint from the environment as for reading."""

    def __init__(self, url: str):
        try:
            s3open.split(url.rstrip("/") + "/x")
        except ValueError as exc:
            raise UserError(f"--shards {exc}") from None
        s3open.require_boto3(url)
        self.where = url.rstrip("/")
        self.staging = tempfile.mkdtemp(prefix="wds-makeshards-")

    def path(self, name: str) -> str:
        return f"{self.where}/{name}"

    def _call(self, name: str, fn, *args):
        try:
            return fn(self.path(name), *args)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise UserError(f"--shards {self.path(name)}: {exc}") from None

    def read(self, name: str) -> bytes | None:
        return self._call(name, lambda url: s3open.read_capped(url, MAX_SMALL, TIMEOUT))

    def write(self, name: str, data: bytes) -> None:
        self._call(name, lambda url: s3open.put_bytes(url, data, TIMEOUT))

    def size(self, name: str) -> int | None:
        return self._call(name, lambda url: s3open.object_size(url, TIMEOUT))

    def publish(self, name: str) -> None:
        """Upload the finished shard from the staging folder, then drop the local copy."""
        local = os.path.join(self.staging, name)
        self._call(name, lambda url: s3open.put_file(url, local, TIMEOUT))
        os.remove(local)

    def remove_tree(self, name: str) -> None:
        """Records in a bucket stay (a few bytes each); the index names what is done."""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.staging)


def open_store(where: str) -> LocalStore | ObjectStore:
    return ObjectStore(where) if s3open.is_object_url(where) else LocalStore(where)
