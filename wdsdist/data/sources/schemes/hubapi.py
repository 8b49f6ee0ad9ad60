"""What the Hugging Face Hub says about a data set, asked through huggingface_hub (the [hf] extra):
a revision's commit, a folder's files, where a file's bytes are. huggingface_hub does what it does
well here (the token from HF_TOKEN or its token file, the endpoint from HF_ENDPOINT, the URLs,
listing and the resolver's headers); the bytes themselves are read by our own reader (hub.py).

Every answer the Hub can give becomes one line a user can act on (``HubError``): a gated data set
without a token or without access, a wrong name, revision or file. A rate limit (429) or a server
error is waited for, as its ``Retry-After`` or ``RateLimit`` header asks, within ``budget`` seconds
(``data.http_retry_s``), and then named; a ``budget`` of 0 tries once, and a transient failure is
then a ``retry.Unavailable`` for the reader's own retries (retry.py).
"""

from __future__ import annotations

import logging
import os
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from wdsdist.data.sources.retry import FIRST_PAUSE, MAX_PAUSE, Unavailable
from wdsdist.errors import UserError

log = logging.getLogger(__name__)

T = TypeVar("T")
EXTRA = "pip install 'wds-distributed[hf]'"
MAX_FILES = 1 << 20  # files a listing may hold: more is no data set's folder but a memory attack


class HubError(OSError):
    """A Hub answer that a retry will not change, said in one line."""


class HubBusy(Unavailable):
    """A rate limit (429) or a server error: a later try may succeed."""


FAILED = (HubError, HubBusy)  # what a Hub request raises when it did not get its answer


def require(url: str = "hf://") -> Any:
    """huggingface_hub, or one line naming the extra that brings it."""
    try:
        import huggingface_hub
    except ImportError:
        raise UserError(f"{url}: hf:// shards need huggingface_hub: {EXTRA}") from None
    return huggingface_hub


def endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT`` (read now, so a process that sets it late is heard), else
    huggingface_hub's."""
    require()
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def page(repo: str) -> str:
    """The data set's page, where access to a gated one is asked for."""
    return f"{endpoint()}/datasets/{repo}"


@dataclass(frozen=True)
class Located:
    """Where a file's bytes are: ``url`` (a signed CDN address, or the Hub itself for a small file)
    and the ``headers`` to send there (the token, only to the Hub's own origin)."""

    url: str
    headers: dict[str, str]
    size: int | None


def _explain(exc: BaseException, repo: str, rev: str, path: str | None) -> tuple[str, float | None]:
    """(one line, seconds to wait before trying again; None: a retry will not help)."""
    require()
    from huggingface_hub import errors

    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.GatedRepoError):
        if status == 401:
            return (
                f"{repo} is a gated data set and no token was sent: set HF_TOKEN (or run `hf auth login`); "
                f"ask for access at {page(repo)}",
                None,
            )
        return f"{repo} is a gated data set and this token has no access to it: ask for access at {page(repo)}", None
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (
            f"no data set {repo} on {endpoint()} (a wrong name, or a private one this token cannot see: HF_TOKEN)",
            None,
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{repo} has no revision {rev!r} (a branch, a tag or a commit)", None
    if isinstance(exc, errors.EntryNotFoundError):
        return f"{repo}@{rev}: no file {path!r} at this revision", None
    if isinstance(exc, errors.HfHubHTTPError) and status is not None:
        if status == 429:
            return f"the Hub's rate limit (429) for {repo}", _rate_wait(exc)
        if status >= 500:
            return f"the Hub answered {status} for {repo}", FIRST_PAUSE
        return f"the Hub answered {status} for {repo}: {' '.join(str(exc).split())[:300]}", None
    if isinstance(exc, UserError | ValueError | TypeError):
        raise exc
    return f"{endpoint()} did not answer for {repo} ({exc.__class__.__name__}: {exc})", FIRST_PAUSE


def _rate_wait(exc: BaseException) -> float:
    """What the 429's headers ask to wait: ``Retry-After``, else the ``RateLimit`` header's reset."""
    headers = exc.response.headers  # type: ignore[attr-defined]
    require()
    from huggingface_hub.utils import parse_ratelimit_headers

    try:
        limit = parse_ratelimit_headers(headers)
        if limit is not None and limit.reset_in_seconds:
            return float(limit.reset_in_seconds)
    except (AttributeError, ValueError):
        pass
    after = headers.get("Retry-After", "")
    return float(after) if after.strip().isdigit() else FIRST_PAUSE


def call(fn: Callable[[], T], repo: str, rev: str, budget: float, path: str | None = None) -> T:
    """``fn()``, a Hub request, tried again for up to ``budget`` seconds while the Hub says to wait."""
    started, tries, pause = time.monotonic(), 0, FIRST_PAUSE
    while True:
        tries += 1
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001  (huggingface_hub's and its HTTP client's, sorted below)
            line, wait = _explain(exc, repo, rev, path)
        if wait is None:
            raise HubError(line)
        spent = time.monotonic() - started
        wait = max(wait, pause)
        if spent + wait > budget:
            if budget <= 0:
                raise HubBusy(line)
            raise HubError(
                f"{line}; gave up after {tries} tries over {spent:.1f} s (data.http_retry_s={budget:g}): try again "
                f"later, or log in (HF_TOKEN) for a higher limit"
            )
        log.warning("%s; trying again in %.1f s", line, wait)
        time.sleep(wait)
        pause = min(pause * 2, MAX_PAUSE)


def _api() -> Any:
    return require().HfApi(endpoint=endpoint())


def commit_of(repo: str, rev: str, timeout: float, budget: float) -> str:
    """The commit a revision (a branch, a tag, a commit) names now."""
    info = call(lambda: _api().dataset_info(repo, revision=rev, timeout=timeout), repo, rev, budget)
    sha = getattr(info, "sha", None)
    if not isinstance(sha, str) or len(sha) != 40:
        raise HubError(f"{repo}@{rev}: the Hub named no commit for this revision (got {sha!r})")
    return sha


def files(repo: str, commit: str, folder: str, timeout: float, budget: float) -> dict[str, int | None]:
    """Every file under ``folder`` (the data set's root when empty) at ``commit``, with its size."""
    require()
    from huggingface_hub import RepoFile

    def listing() -> dict[str, int | None]:
        found: dict[str, int | None] = {}
        tree = _api().list_repo_tree(
            repo, path_in_repo=folder or None, revision=commit, repo_type="dataset", recursive=True
        )
        for entry in tree:
            if isinstance(entry, RepoFile):
                found[entry.path] = entry.size
                if len(found) > MAX_FILES:
                    raise HubError(f"{repo}@{commit}: more than {MAX_FILES} files under {folder or '/'}")
        return found

    return call(listing, repo, commit, budget, folder or None)


def locate(repo: str, commit: str, path: str, timeout: float, budget: float) -> Located:
    """Where ``path``'s bytes at ``commit`` (or a branch, unpinned) are: one request to the Hub's
    resolver, which answers a redirect to a signed CDN address (or, for a small file, the file
    itself); a Hub that answers for another commit than the one asked for is refused."""
    hf = require()
    ep = endpoint()
    url = hf.hf_hub_url(repo, path, repo_type="dataset", revision=commit, endpoint=ep)

    def head() -> Any:
        return hf.get_hf_file_metadata(url, timeout=timeout, endpoint=ep, retry_on_errors=False)

    meta = call(head, repo, commit, budget, path)
    if meta.commit_hash and len(commit) == 40 and meta.commit_hash != commit:
        raise HubError(f"{repo}: asked for {path} at {commit}, the Hub sent commit {meta.commit_hash}")
    token = hf.get_token()
    own = _origin(meta.location) == _origin(ep)
    headers = {"Authorization": f"Bearer {token}"} if token and own else {}
    return Located(meta.location, headers, meta.size)


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()
