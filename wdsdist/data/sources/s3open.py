"""The one way s3:// and gs:// are read (shard streams, index fetches) and an index is uploaded.

boto3, never a shell or a CLI, imported on the first object-store URL, so a run on local or
http(s) shards never pays for it. Credentials come from boto3's chain (environment, profile,
SSO, container or instance role). The endpoint is ``endpoint_url`` where given (the config's
``data.s3_endpoint_url``), else boto3's own (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, a
profile's ``endpoint_url``), else AWS: that is how MinIO, Ceph and R2 are reached.

gs:// goes to Google Cloud Storage's S3-compatible XML API (``GCS_ENDPOINT``) with HMAC keys
taken from the same chain; Google's own credentials (ADC, service-account JSON) are not used.

The limits are httpopen's, so a store cannot hold a shard longer than a web server can:
connecting and each read wait at most ``timeout`` seconds (botocore's timeouts), and the body is
read one socket receive at a time (urllib3's ``read1``) through httpopen's meter, which fails a
stream that delivers less than ``min_rate`` bytes per second of waiting. Only the time blocked
in a receive counts, as for http(s). Failed requests are retried as botocore's retry settings
say (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``); beyond that, a shard read that fails while
streaming or opening is resumed from the byte it reached by the opener (retry.py), as for http(s).

A client belongs to one process: boto3's clients and their connection pools must not cross a
fork, so each DataLoader worker makes its own on first use (nothing here is pickled).
"""

from __future__ import annotations

import importlib.util
import io
import os
import posixpath
import threading
import time
from typing import Any

from wdsdist.data.sources.httpopen import DEFAULT_MIN_RATE, Meter
from wdsdist.data.sources.retry import Unavailable
from wdsdist.errors import UserError

SCHEMES = ("s3", "gs")
PLACE = "bucket"  # what an index in a store may not lead outside
GCS_ENDPOINT = "https://storage.googleapis.com"
_BUFFER = 1 << 20  # bytes a shard stream asks of the socket at most per receive

_REFUSED_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken")

_lock = threading.Lock()
_clients: dict[tuple, Any] = {}


def _forget_after_fork() -> None:
    # A forked child (a DataLoader worker) must not use its parent's clients, nor a lock
    # another parent thread may have held at the fork.
    global _lock
    _lock = threading.Lock()
    _clients.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def is_object_url(url: str) -> bool:
    return url.startswith(("s3://", "gs://"))


def split(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of an s3:// or gs:// URL; ValueError when one is missing."""
    scheme, sep, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in SCHEMES or not sep:
        raise ValueError(f"not an s3:// or gs:// URL: {url}")
    if not bucket or not key:
        raise ValueError(f"{url}: need {scheme}://BUCKET/KEY")
    return scheme, bucket, key


def is_object_key(url: str) -> bool:
    """An s3:// or gs:// URL with a bucket and a key."""
    try:
        split(url)
    except ValueError:
        return False
    return True


def bucket_url(url: str) -> str:
    """``scheme://bucket/``: the place an index in that bucket may name shards in."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.partition('/')[0]}/"


def join(base: str, relative: str) -> str | None:
    """``relative`` resolved against the folder of the object ``base`` (as urljoin does for
    http, which it does not know these schemes for); None where ``..`` leaves the bucket."""
    scheme, bucket, key = split(base)
    path = posixpath.normpath(posixpath.join(posixpath.dirname(key), relative))
    if path in (".", "..") or path.startswith(("../", "/")):
        return None
    return f"{scheme}://{bucket}/{path}"


def folder_url(url: str) -> str:
    """The folder an object is in, ending in ``/``."""
    scheme, bucket, key = split(url)
    folder = posixpath.dirname(key)
    return f"{scheme}://{bucket}/{folder}/" if folder else f"{scheme}://{bucket}/"


def require_boto3(url: str) -> None:
    """Refuse, in one line naming the extra that brings it, an s3:// or gs:// URL on an install
    without boto3 (``pip install wds-distributed`` leaves it out)."""
    if importlib.util.find_spec("boto3") is None:
        scheme = url.split("://", 1)[0]
        raise UserError(f"{url}: {scheme}:// shards need boto3: pip install 'wds-distributed[s3]'")


def reset_clients() -> None:
    """Forget this process's clients (credentials or endpoints changed, as in tests)."""
    with _lock:
        _clients.clear()


def _client(scheme: str, endpoint_url: str | None, timeout: float) -> Any:
    with _lock:
        key = (scheme, endpoint_url, timeout)
        client = _clients.get(key)
        if client is None:
            require_boto3(f"{scheme}://")
            import boto3
            from botocore.config import Config

            config = Config(
                connect_timeout=timeout,
                read_timeout=timeout,
                # The CRC headers botocore >= 1.36 adds by default are refused by GCS's XML API
                # and older S3-compatible stores; shard bodies are read past botocore anyway.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
            if scheme == "gs":
                endpoint_url = endpoint_url or GCS_ENDPOINT
            client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
            _clients[key] = client
        return client


def _no_credentials(scheme: str) -> str:
    if scheme == "gs":
        return (
            "no credentials: gs:// is read through Cloud Storage's S3-compatible API with HMAC keys, "
            "given as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or in an AWS_PROFILE "
            "(application-default credentials are not used)"
        )
    return (
        "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
        "or run where an instance or container role gives them"
    )


def _os_error(exc: Exception, url: str, endpoint: str, timeout: float) -> OSError:
    """botocore's and urllib3's exceptions as one-line OSErrors; the caller names the URL."""
    from botocore import exceptions as bx

    scheme, bucket, key = split(url)
    if isinstance(exc, bx.NoCredentialsError):
        return PermissionError(_no_credentials(scheme))
    if isinstance(exc, bx.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "")) or "?"
        message = error.get("Message", "") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return FileNotFoundError(f"no bucket {bucket!r} at {endpoint}")
        if code in ("NoSuchKey", "404") or status == 404:
            return FileNotFoundError(f"no object {key!r} in bucket {bucket!r} at {endpoint}")
        if code in (
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
            "TokenRefreshRequired",
        ):
            return PermissionError(f"credentials refused by {endpoint} ({code}: {message})")
        if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
            return PermissionError(f"access denied by {endpoint} ({code}: {message})")
        if code == "InvalidRange":
            return OSError(f"byte range beyond the object's end ({error.get('ActualObjectSize', '?')} bytes)")
        if isinstance(status, int) and (status >= 500 or status == 429):  # SlowDown, InternalError: try later
            return Unavailable(f"{endpoint} answered {code}: {message}")
        return OSError(f"{endpoint} answered {code}: {message}")
    if isinstance(exc, (bx.ConnectTimeoutError, bx.EndpointConnectionError)):
        return ConnectionError(f"cannot reach {endpoint} ({exc.__class__.__name__})")
    if isinstance(exc, bx.ReadTimeoutError):
        return TimeoutError(f"no answer from {endpoint} in {timeout:g} s")
    if isinstance(exc, bx.BotoCoreError):
        return OSError(" ".join(str(exc).split()))
    return OSError(" ".join(str(exc).split()) or exc.__class__.__name__)


def endpoint(url: str, timeout: float, endpoint_url: str | None = None) -> str:
    """The endpoint the object at ``url`` is read from: ``endpoint_url``, or boto3's own."""
    scheme, _, _ = split(url)
    return _client(scheme, endpoint_url, timeout).meta.endpoint_url


def _call(url: str, timeout: float, endpoint_url: str | None, method: str, **params: Any) -> Any:
    """One request for the object at ``url``; errors as one-line OSErrors."""
    from botocore import exceptions as bx

    scheme, bucket, key = split(url)
    client = None
    try:
        client = _client(scheme, endpoint_url, timeout)  # a profile that does not exist fails here
        return getattr(client, method)(Bucket=bucket, Key=key, **params)
    except (bx.BotoCoreError, bx.ClientError) as exc:
        endpoint = client.meta.endpoint_url if client is not None else endpoint_url or "the default endpoint"
        raise _os_error(exc, url, endpoint, timeout) from None


class _Body(io.RawIOBase):
    """An object's body, read one socket receive at a time through the meter."""

    def __init__(self, raw: Any, meter: Meter, url: str, timeout: float) -> None:
        self._raw, self._meter, self._url, self._timeout = raw, meter, url, timeout
        self._eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        from urllib3 import exceptions as ux

        start = time.monotonic()
        try:
            data = self._raw.read1(len(buffer))
        except ux.ReadTimeoutError:
            raise TimeoutError(f"no data for {self._timeout:g} s") from None
        except ux.HTTPError as exc:  # a connection broken mid-body (IncompleteRead, reset)
            raise ConnectionError(f"connection broken: {' '.join(str(exc).split())}") from None
        self._meter.add(len(data), time.monotonic() - start)
        n = len(data)
        if n == 0 and len(buffer):
            # botocore leaves urllib3's length check off: a body cut short would end the tar
            # quietly (at a header's place, as a shard's end), its remaining samples lost.
            left = getattr(self._raw, "length_remaining", None)
            if left:
                raise ConnectionError(f"connection broken: the body ended {left} bytes short of its Content-Length")
            self._eof = True
        memoryview(buffer)[:n] = data
        return n

    def close(self) -> None:
        if not self.closed:
            # A body read to its end gives its connection back to the pool; one left midway
            # (a reader that stopped at the tar's end blocks) must not, or the next request
            # on that connection would read the rest of this one.
            if self._eof:
                self._raw.release_conn()
            else:
                self._raw.close()
        super().close()


def open_url(
    url: str,
    timeout: float,
    min_rate: int = DEFAULT_MIN_RATE,
    start: int = 0,
    end: int | None = None,
    *,
    endpoint_url: str | None = None,
) -> io.BufferedReader:
    """Open an s3:// or gs:// object for reading, from byte ``start`` up to ``end`` (exclusive;
    None: its end), with the limits above (``min_rate`` 0: no rate check). The same arguments as
    httpopen.open_url, plus the endpoint. Raises OSError naming what went wrong."""
    params: dict[str, Any] = {}
    if start < 0 or (end is not None and end <= start):
        raise ValueError(f"{url}: bad byte range {start}-{end}")
    if start > 0 or end is not None:
        params["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    response = _call(url, timeout, endpoint_url, "get_object", **params)
    raw = response["Body"]._raw_stream  # urllib3's response: read1 gives one receive at a time
    if params and response["ResponseMetadata"]["HTTPStatusCode"] != 206:
        raw.close()
        raise OSError(f"the store ignored the byte range {params['Range']} (answered with the whole object)")
    reader = io.BufferedReader(_Body(raw, Meter(timeout, min_rate), url, timeout), _BUFFER)
    # As an http response's headers: what the node cache (cache.py) checks a download against and records.
    reader.headers = {  # type: ignore[attr-defined]
        "Content-Length": str(response.get("ContentLength", "")),
        "ETag": response.get("ETag"),
        "Last-Modified": str(response.get("LastModified") or ""),
    }
    return reader


def read_capped(
    url: str, limit: int, timeout: float, min_rate: int = DEFAULT_MIN_RATE, *, endpoint_url: str | None = None
) -> bytes:
    """The object's bytes, refused (ValueError) when it is larger than ``limit``; never holds
    more than ``limit`` + 1 bytes of it."""
    with open_url(url, timeout, min_rate, endpoint_url=endpoint_url) as body:
        data = body.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is more than the limit of {limit} bytes")
    return data


def put_bytes(url: str, data: bytes, timeout: float, *, endpoint_url: str | None = None) -> None:
    """Write ``data`` as the object at ``url`` (one PUT: whole or not at all)."""
    _call(url, timeout, endpoint_url, "put_object", Body=data)


def put_file(url: str, path: str, timeout: float, *, endpoint_url: str | None = None) -> None:
    """Upload the local file ``path`` as the object at ``url``, streamed from disk (multipart when
    large, so a shard of a GB is never held in memory); the object appears when the upload completes."""
    _call(url, timeout, endpoint_url, "upload_file", Filename=path)


def object_size(url: str, timeout: float, *, endpoint_url: str | None = None) -> int:
    """The object's size in bytes (one HEAD); FileNotFoundError where there is none."""
    return int(_call(url, timeout, endpoint_url, "head_object")["ContentLength"])


def check_credentials(url: str) -> None:
    """PermissionError when boto3's chain finds no credentials for ``url``'s store. Asks no
    store; on a machine without credentials in the environment or a profile, boto3 asks the
    instance metadata service (a second at most)."""
    import boto3
    from botocore.exceptions import BotoCoreError

    scheme, _, _ = split(url)
    try:
        credentials = boto3.session.Session().get_credentials()
    except BotoCoreError as exc:  # an AWS_PROFILE that does not exist, a broken config file
        raise PermissionError(f"no credentials: {' '.join(str(exc).split())}") from None
    if credentials is None:
        raise PermissionError(_no_credentials(scheme))
