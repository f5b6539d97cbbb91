"""``driftlab reproduce``: regenerate the tables of docs/reproduction.md from the shipped sweeps (issue 29).

Every table of docs/reproduction.md that a sweep's report prints is copied from a *record*,
``docs/reproduction/NAME.md``; markers in the doc say where each table comes from.
``driftlab reproduce NAME ... --out DIR`` runs each sweep with ``driftlab sweep NAME --out DIR/NAME`` itself,
in a child process (a partial DIR/NAME resumes exactly), writes its record, then rewrites every block of
NAME in the doc. ``driftlab/experiments/reproduce/reproduction_docs_test.py`` checks that every block is exactly
what ``render_block`` makes of the record it cites, and that no numeric table of the doc is unmarked.

The package does one job per module; import names from the module (this package re-exports none):

    records   a record: its header and report, reading and writing it, the report's tables, selectors; ReproduceError
    markers   the markers of the doc: their forms, parsing and checking them, the tables of the doc
    blocks    a regenerated block: rendering it from a record, checking the doc against its records, rewriting it
    running   running the sweeps, writing records and the doc (``reproduce``), ``--dry-run``, ``--list``
    command   the command line's arguments and entry point (no torch import: ``driftlab reproduce --help`` stays quick)

Each module imports only the ones above it in this list, and none imports torch when imported.
"""
