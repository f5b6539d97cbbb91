"""``driftlab reproduce``'s command line: its help texts, its arguments (``add_arguments``) and entry point (``command``).

driftlab/cli.py imports them from here lazily, and this module imports only the standard library and
this package's modules, none of which imports torch when imported, so ``driftlab reproduce --help`` stays quick.
"""

from __future__ import annotations

from pathlib import Path

from driftlab.experiments.reproduce.records import ReproduceError
from driftlab.experiments.reproduce.running import default_docs, dry_run, list_markers, reproduce, rewrite_items_block

DESCRIPTION = """Regenerate the tables of docs/reproduction.md from the shipped sweeps. For each NAME (default: every
sweep a marker of the doc names), run `driftlab sweep NAME --out DIR/NAME` (a partial DIR/NAME resumes
exactly), write the record RECORD/NAME.md (commit, command, date, machine, wall time, then the report's
text, figures left out), and rewrite every `<!-- regenerated from .../NAME.md -->` block of the doc from it;
a `<!-- not regenerated: sweep=NAME; ... -->` marker and the hand-typed table under it become such a block
(the replaced table is kept in DIR/replaced-tables.md). At a named scale (`--scale paper`, or NAME@paper) the
runs, the record and the blocks are NAME@SCALE's own (DIR/NAME@paper, RECORD/NAME@paper.md), so a paper-scale run
never replaces the default scale's. driftlab/experiments/reproduce/reproduction_docs_test.py checks that every block is what
its record prints."""

EPILOG = """examples:
  driftlab reproduce --list                                   each marker of the doc: line, sweep, status
  driftlab reproduce --items                                  the status table of the headline items, from the records
  driftlab reproduce --dry-run --out runs/reproduction        what would run (runs, stated minutes) and be written
  driftlab reproduce --out runs/reproduction                  every sweep the doc names, at the default scale
  driftlab reproduce decaying-k-quadratic --out runs/repro    one sweep; run it again to resume
  driftlab reproduce feddyn-table2-partial@paper --out runs   one sweep at its paper scale: its own record and blocks

docs/reproduction.md's first section describes the markers."""


HELP = "regenerate docs/reproduction.md's tables from the shipped sweeps, recording commit and command"


def add_arguments(parser) -> None:
    """``driftlab reproduce``'s arguments, on its parser (``driftlab/cli.py`` makes it, with ``HELP``, ``DESCRIPTION``
    and ``EPILOG``)."""
    parser.add_argument(
        "sweeps",
        nargs="*",
        metavar="NAME",
        help="shipped sweeps to run, NAME@SCALE at a named scale (default: every sweep a marker of --docs names); "
        "key=value words are overrides for every run",
    )
    parser.add_argument(
        "--out", help="folder of the sweeps' directories, DIR/NAME (created; reused to resume); required unless --list"
    )
    parser.add_argument(
        "--docs", help="the doc to rewrite (default: docs/reproduction.md here, else the driftlab checkout's)"
    )
    parser.add_argument(
        "--record", help="folder of the records NAME.md (default: the doc's folder / the doc's name, docs/reproduction)"
    )
    parser.add_argument(
        "--scale",
        help="a named scale of every NAME, e.g. paper: NAME@paper's runs, record and blocks (default: the default scale)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would run and be written; run and change nothing"
    )
    parser.add_argument(
        "--list", action="store_true", help="print each marker of the doc (line, sweep, status) and exit"
    )
    parser.add_argument(
        "--items",
        action="store_true",
        help="rewrite the doc's headline items table from RECORD/items.toml and the records, run nothing, and exit",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace files of the names this command writes (DIR/NAME, DIR/replaced-tables.md, RECORD/NAME.md, and the "
        "sweeps' own) that driftlab did not write; without it such a file stops the command before anything runs",
    )
    parser.set_defaults(overrides=[])


def command(args) -> int:
    """Run ``driftlab reproduce`` from parsed arguments."""
    names = [word for word in args.sweeps if "=" not in word]
    overrides = [*(word for word in args.sweeps if "=" in word), *args.overrides]
    docs = Path(args.docs) if args.docs else default_docs()
    if not docs.is_file():
        raise ReproduceError(f"{docs} is not a file; give the doc to regenerate with --docs FILE")
    record_dir = Path(args.record) if args.record else docs.parent / docs.stem
    if args.list:
        print("\n".join(list_markers(docs, record_dir)))
        return 0
    if args.items:
        changed = rewrite_items_block(docs, record_dir)
        print(
            f"{docs}: headline items {'rewritten' if changed else 'already current'} from {record_dir / 'items.toml'}"
        )
        return 0
    if args.out is None:
        raise ReproduceError("driftlab reproduce needs --out DIR, the folder of the sweeps' directories (or --list)")
    if args.dry_run:
        print("\n".join(dry_run(names, Path(args.out), docs, record_dir, args.scale, overrides)))
        return 0
    reproduce(names, Path(args.out), docs, record_dir, args.scale, overrides, force=args.force)
    return 0


__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "command"]
