"""The one error type that reaches the user as a single line, and how the command-line tools
print (the library itself only logs, through ``logging``, and raises)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class JobError(Exception):
    """A job that cannot go on for a reason outside the user's input (another rank died): one
    line, exit code 1."""


class DataError(Exception):
    """A shard or sample that cannot be read; the message names the shard and the key."""


def die(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


class ConsoleHandler(logging.Handler):
    """Each message one line on stderr, as the tools print their own: ``warning: ...``,
    ``note: ...`` (info), ``error: ...``; debug lines (shard traces) bare. It writes to
    ``sys.stderr`` as it is when the message comes, so a redirection made later is followed."""

    PREFIX = {logging.DEBUG: "", logging.INFO: "note: ", logging.WARNING: "warning: ", logging.ERROR: "error: "}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = self.PREFIX.get(record.levelno, "error: " if record.levelno > logging.ERROR else "")
            sys.stderr.write(f"{prefix}{record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 (logging's own way to report a failed write)
            self.handleError(record)


def console_logging(level: int = logging.INFO) -> None:
    """The tools' format for the package's messages (``logging.getLogger("wdsdist")``): one
    ``ConsoleHandler``, installed once, the messages kept from the root logger's handlers so a
    line is never printed twice. A program that uses the loader as a library leaves this out and
    routes the messages its own way."""
    logger = logging.getLogger("wdsdist")
    if not any(isinstance(h, ConsoleHandler) for h in logger.handlers):
        logger.addHandler(ConsoleHandler())
    logger.setLevel(level)
    logger.propagate = False


def run_cli(main: Callable[[], int | None]) -> NoReturn:
    """Run a command-line entry point: the package's messages in the tools' format, and a
    UserError one line and exit 2."""
    console_logging()
    try:
        rc = main()
    except UserError as exc:
        die(str(exc))
    except KeyboardInterrupt:
        die("interrupted", 130)
    raise SystemExit(rc or 0)


_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


class CliParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one 'error:' line (not the usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        extra = message.removeprefix("unrecognized arguments:").split() if message.startswith("unrecognized") else []
        if any(word.endswith(_SHARD_SUFFIXES) for word in extra):
            # bash expands an unquoted a-{000..009}.tar into one word per shard; the first went to the option.
            message += "; a brace pattern the shell expanded? quote it: 'data/train-{000000..000009}.tar'"
        raise UserError(f"{message} (see {self.prog} --help)")


def integer(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low, with the bad value named."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse
