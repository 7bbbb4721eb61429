"""``stoic cache list`` and ``stoic cache prune``: the cache of converted GGUF models.

Both take ``--cache-dir``; without it the cache root is the one ``stoic serve`` uses
(``$STOIC_CACHE_DIR``, else ``$XDG_CACHE_HOME/stoic``, else ``~/.cache/stoic``). Output goes to
stdout; the exit status is 0, or 2 for a usage error.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..gguf import CacheEntry

__all__ = ["add_cache_parser", "run_cache"]

_CACHE_DIR_HELP = "the cache root (default: $STOIC_CACHE_DIR, else ~/.cache/stoic)"


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_cache_parser(sub: Any) -> None:
    """Add ``cache`` (with ``list`` and ``prune``) to the ``stoic`` subcommands ``sub``."""
    # SUPPRESS: --cache-dir may come before or after the action without one hiding the other
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", type=Path, default=argparse.SUPPRESS, help=_CACHE_DIR_HELP)
    cache = sub.add_parser(
        "cache",
        parents=[common],
        help="list or prune the cache of converted GGUF models",
        description="The first start of a GGUF model converts it into this cache; later starts "
        "(in any virtualenv) load the converted copy of an identical file.",
    )
    actions = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    actions.add_parser(
        "list", parents=[common], help="entries: key, size on disk, last used, source file"
    )
    prune = actions.add_parser(
        "prune",
        parents=[common],
        help="remove entries and print what was freed",
        description="Without an option, removes the entries no start uses any more (those of "
        "older stoic versions, keyed by path). Unfinished conversions are removed once they are "
        "an hour old. A running server keeps its loaded model; replacing its worker process "
        "converts the model again.",
    )
    which = prune.add_mutually_exclusive_group()
    which.add_argument("--all", dest="everything", action="store_true", help="remove every entry")
    which.add_argument(
        "--older-than",
        type=_days,
        metavar="DAYS",
        help="remove the entries not used for more than DAYS days",
    )


def run_cache(args: argparse.Namespace) -> int:
    """Run ``stoic cache list|prune``; return the exit status (0)."""
    # here, not at the top: stoic.gguf imports torch, and ``stoic serve`` builds this parser
    # before it starts its worker's interpreter (stoic._prestart), which should not wait for it
    from ..gguf import CONVERTED, default_cache_dir, list_entries, remove_entry, select_for_prune

    root: Path = getattr(args, "cache_dir", None) or default_cache_dir()
    where = root / CONVERTED
    if args.cache_command == "list":
        entries = list_entries(root)
        if not entries:
            print(f"no converted models in {where}")
            return 0
        _print_table(entries)
        total = sum(e.size for e in entries)
        print(f"{_count(len(entries))}, {_size(total)} in {where}")
        return 0
    chosen = select_for_prune(
        list_entries(root), everything=args.everything, older_than_days=args.older_than
    )
    for entry in chosen:
        remove_entry(entry)
        print(f"removed {entry.key} ({_size(entry.size)}, {_source(entry)})")
    freed = sum(e.size for e in chosen)
    print(f"freed {_size(freed)} ({_count(len(chosen))}) in {where}")
    return 0


def _print_table(entries: list[CacheEntry]) -> None:
    rows = [("KEY", "SIZE", "LAST USED", "SOURCE")]
    rows += [(e.key, _size(e.size), _when(e.last_used), _source(e)) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)]
        print("  ".join([*cells, row[3]]))


def _source(entry: CacheEntry) -> str:
    if entry.kind == "legacy":
        return "(an older stoic's entry, keyed by path: unused; `stoic cache prune` removes it)"
    if entry.kind == "partial":
        return "(an unfinished conversion)"
    return entry.source or "(unknown)"


def _count(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch))


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
