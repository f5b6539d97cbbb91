"""``driftlab data``: the data sets, partitions and models a config can name (``list``), a config's clients and
their data (``describe``), and the official files fetched (``download``)."""

from __future__ import annotations

import argparse
import sys


def _data_command(args: argparse.Namespace) -> int:
    from driftlab.data import registry as data_sets
    from driftlab.data.download import NOT_DOWNLOADABLE
    from driftlab.experiments.config import PARTITIONS, load_config
    from driftlab.experiments.run.datasets import build_dataset, data_location, data_search_paths
    from driftlab.models import registry as model_registry

    if args.data_command == "list":
        print("data sets (data.name), and whether their files are where data.root's default looks:")
        for name in data_sets.REGISTRY.names():  # the built-ins, then installed plugins (entry point driftlab.datasets)
            info = data_sets.REGISTRY.entries[name]
            origin = f" ({data_sets.REGISTRY.describe(info)})" if data_sets.REGISTRY.is_plugin(info) else ""
            print(f"  {name:18s} {info.description}{origin}")
            if info.location:
                looked = data_search_paths(info.location)
                found = next((path for path in looked if path.exists()), None)
                state = f"present: {found}" if found else f"missing: looked in {', '.join(map(str, looked))}"
                print(f"  {'':18s} [{state}]")
        print("  (files elsewhere: data.root=PATH, or DRIFTLAB_DATA=DIR holding the folders named above)")
        print("partitions (data.partition): " + ", ".join(PARTITIONS))
        print("models (model.name): " + ", ".join(model_registry.names()))
        print("downloadable (driftlab data download NAME --to DIR): " + ", ".join(sorted(data_sets.downloads())))
        for name, reason in NOT_DOWNLOADABLE.items():
            print(f"  {name}: {reason}")
        return 0
    if args.data_command == "describe":
        config = load_config(args.config, args.overrides)
        dataset = build_dataset(config.data, config.seed)
        print(f"data set: {config.data.name}   files: {data_location(config.data) or 'generated'}")
        for key, value in dataset.describe().items():
            print(f"  {key}: {value}")
        return 0
    if args.data_command == "download":
        from driftlab.data.download import DownloadError, download

        try:
            for path in download(args.name, args.to, registry=data_sets.downloads(), force=args.force):
                print(path)
        except DownloadError as error:
            print(f"driftlab: error: {error}", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(args.data_command)
