"""Shard specs on the command line: a brace pattern made safe for Hydra's grammar, or refused in
one line where the shell already expanded it (``shard_argv``, run before Hydra parses anything)."""

from __future__ import annotations

import os

from hydra.errors import HydraException

from wdsdist.errors import UserError

SHARD_KEYS = ("data.train_shards", "data.val_shards")


def _is_hydra_override(text: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_override(text)
    except HydraException:
        return False
    return True


def _brace_pattern(values: list[str]) -> str | None:
    """A brace pattern that expands to these values, as the shell expanded it: ``{first..last}``
    for consecutive numbers, else ``{a,b,...}`` for a few."""
    prefix = os.path.commonprefix(values)
    suffix = os.path.commonprefix([v[len(prefix) :][::-1] for v in values])[::-1]
    # Keep a number's leading zeros and digits inside the braces, as the user typed it.
    digits = "0123456789"
    head, tail = prefix.rstrip(digits), suffix.lstrip(digits)
    middles = [v[len(head) : len(v) - len(tail)] for v in values]
    widths = {len(m) for m in middles}
    if all(m.isdigit() for m in middles) and (len(widths) == 1 or all(m == str(int(m)) for m in middles)):
        numbers = [int(m) for m in middles]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{head}{{{middles[0]}..{middles[-1]}}}{tail}"
    if len(values) <= 5:
        return f"{prefix}{{{','.join(v[len(prefix) : len(v) - len(suffix)] for v in values)}}}{suffix}"
    return None


def _shard_key(arg: str) -> str | None:
    name = arg.partition("=")[0].lstrip("+")
    return name if "=" in arg and name in SHARD_KEYS else None


def _refuse_expanded(name: str, values: list[str]) -> None:
    pattern = _brace_pattern(values)
    quote = f"'{name}={pattern}'" if pattern else f"the whole word, '{name}=...{{A..B}}...'"
    shown = f"{values[0]} ... {values[-1]}" if len(values) > 2 else " ".join(values)
    raise UserError(
        f"{name} is given {len(values)} times in a row ({shown}): the shell expanded a brace pattern? "
        f"Quote it: {quote}; Hydra would keep only the last one"
    )


def shard_argv(argv: list[str]) -> list[str]:
    """The command line with brace specs for the shard keys made safe for Hydra's grammar.

    A literal ``data.train_shards=web-{000000..000009}.tar`` (the shell left it whole: quoted, or a
    launcher passing words as they are) is refused by Hydra's grammar; it gets Hydra's quotes here.
    Only a shard key whose value Hydra would refuse is changed, so every override Hydra accepts means
    what it meant. A shard key given in several words in a row is what bash makes of an unquoted
    brace pattern (one word per shard, and Hydra would keep only the last): an error that says to
    quote it. Apart, the last one wins as with any Hydra override (a script's default, then the user's).
    """
    out = []
    i = 0
    while i < len(argv):
        name = _shard_key(argv[i])
        if name is None:
            out.append(argv[i])
            i += 1
            continue
        run = i + 1
        while run < len(argv) and _shard_key(argv[run]) == name:
            run += 1
        if run - i > 1:
            _refuse_expanded(name, [arg.partition("=")[2] for arg in argv[i:run]])
        key, _, value = argv[i].partition("=")
        quoted = f'{key}="{value}"'
        if not _is_hydra_override(argv[i]) and not any(c in value for c in "\\'\"") and _is_hydra_override(quoted):
            out.append(quoted)
        else:
            out.append(argv[i])
        i += 1
    return out
