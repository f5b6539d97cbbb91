"""``driftlab flower new`` and ``driftlab flower check``: a Flower app project for a config, and its parity check.

``write_project(directory, config)`` writes a ready Flower app project::

    DIR/pyproject.toml             [project], [tool.flwr.app] components and run config
    DIR/README.md                  the commands that run it, on one machine and on real devices
    DIR/driftlab_app/__init__.py
    DIR/driftlab_app/apps.py       server = server_app(CONFIG), client = client_app(CONFIG, load=...)
    DIR/driftlab_app/driftlab_config.json   the resolved config (what `driftlab config CONFIG` prints)

It writes only those names, and only where the directory holds none of them or only the files an earlier
``driftlab flower new`` wrote there unchanged (``driftlab.owned_folder``): a project file the user edited (say
``load_client_data`` in apps.py) or a file of their own is never replaced without ``--force``, and nothing else
in the directory is touched.  ``check(config, rounds)`` runs the config under Flower's
simulation engine and under the simulator's sequential backend and compares
the final models bit for bit (this module imports no ``flwr``; ``check`` does).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from driftlab.errors import ConfigError
from driftlab.features import capabilities
from driftlab.features.drivers import DEPLOYMENT_KEY
from driftlab.owned_folder import claim

PACKAGE = "driftlab_app"
CONFIG_NAME = "driftlab_config.json"
# What the generated files say: they travel to other machines, where driftlab's checkout may lie anywhere.
INSTALL_HINT = 'pip install -e "PATH/TO/driftlab[flower]" (driftlab is installed from its checkout)'


def flower_installed() -> bool:
    """Whether ``flwr`` can be imported (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("flwr") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation is no installation
        return False


def _project_name(directory: Path) -> str:
    """A [project] name Flower accepts (letters, digits, ``-``), from the directory's name."""
    name = "".join(character if character.isalnum() else "-" for character in directory.name.lower()).strip("-")
    return name if name and name[0].isalpha() else f"driftlab-{name or 'app'}".rstrip("-")


def project_files(config: Any, directory: Path, source: str) -> dict[str, str]:
    """The files of the project for ``config`` (an ExperimentConfig) written to ``directory``, by relative path."""
    name = _project_name(directory)
    run_dir = (directory / "run").resolve()
    pyproject = f'''# A Flower app running the driftlab config {source} (written by `driftlab flower new`).
# Every node and the SuperLink's ServerApp need driftlab with Flower installed: {INSTALL_HINT}

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "driftlab {config.algorithm.name} on Flower"
license = "Apache-2.0"
dependencies = []  # driftlab[flower] must be installed on every machine; see README.md

[tool.hatch.build.targets.wheel]
packages = ["{PACKAGE}"]

[tool.flwr.app]
publisher = "driftlab"
# Only the app goes into the FAB `flwr run` sends, never the run directory, reports, Flower's home or node states beside it.
fab-include = ["pyproject.toml", "README.md", "driftlab_app/**"]

[tool.flwr.app.components]
serverapp = "{PACKAGE}.apps:server"
clientapp = "{PACKAGE}.apps:client"

[tool.flwr.app.config]
# Where the ServerApp writes the run directory (config.json, metrics.jsonl, checkpoints): `driftlab report` reads it.
out-dir = {json.dumps(str(run_dir))}
# true: continue the run in out-dir from its checkpoint (after a restart of the SuperLink or the ServerApp).
resume = false
# Seconds the server waits: before round 1 for every client's node to register, then for each kind of reply
# (a later reply counts as missing: its client is inactive that round).
first-registration-timeout = 120.0
register-timeout = 30.0
train-timeout = 600.0
commit-timeout = 10.0
# A reply farther from "did not move" than this multiple of the round's median reply is dropped (its client inactive
# that round) instead of entering the aggregate; 0: no bound.
reply-bound = 1000.0
'''
    apps = f'''"""The Flower apps of this project: driftlab's server and client halves for {CONFIG_NAME} (written by `driftlab flower new`)."""

from pathlib import Path

from driftlab.flower.apps import client_app, server_app

CONFIG = Path(__file__).with_name("{CONFIG_NAME}")

# How a node reads the data of a client it serves: a function client_id -> (inputs, targets), two tensors.
# None: every node loads the config's data set and serves each client's rows of it, exactly as the simulator
# partitions it (what makes a deployment bit-identical to `driftlab run`).  On real devices, read the
# device's own data here, e.g.
#
#     def load_client_data(client_id):
#         arrays = numpy.load(f"/data/client-{{client_id}}.npz")
#         return torch.from_numpy(arrays["inputs"]), torch.from_numpy(arrays["targets"])
load_client_data = None

server = server_app(CONFIG)
client = client_app(CONFIG, load=load_client_data)
'''
    readme = f"""# {name}: driftlab {config.algorithm.name} on Flower

Written by `driftlab flower new` for the driftlab config `{source}`
(resolved in `{PACKAGE}/{CONFIG_NAME}`; the run directory goes to `out-dir` in `pyproject.toml`).
Every machine needs driftlab with Flower: `{INSTALL_HINT}`.

## On one machine

```bash
export FLWR_HOME=$PWD/.flwr-home FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
flower-superlink --insecure --host 127.0.0.1 --port 9090 &
flower-supernode --insecure --superlink 127.0.0.1:9090 --port 9100 --node-config "partition-id=0 num-partitions=2 state-dir='$PWD/node-0'" &
flower-supernode --insecure --superlink 127.0.0.1:9090 --port 9101 --node-config "partition-id=1 num-partitions=2 state-dir='$PWD/node-1'" &
mkdir -p $FLWR_HOME && cat > $FLWR_HOME/config.toml <<EOF
[superlink]
default = "loopback"

[superlink.loopback]
address = "127.0.0.1:9090"
insecure = true
EOF
flwr run . loopback --stream
driftlab report {run_dir} --out report
```

Node `i` of `n` serves the driftlab clients `i, i+n, i+2n, ...`; `client-ids='0,3,7'` names them instead.
The run config in `pyproject.toml` (`out-dir`, `resume`, `first-registration-timeout`, `register-timeout`,
`train-timeout`, `commit-timeout`, `reply-bound`) can be changed per run: `flwr run . loopback --stream -c 'train-timeout=120'`.
Each node keeps its clients' states (SCAFFOLD's controls, FedDyn's λ, error-feedback residuals) in `state-dir`.
`driftlab flower check {source} --rounds 3` compares Flower's simulation engine with the simulator bit for bit.

## On real devices

- Run `flower-superlink` on a machine the devices reach; it listens on one port (`--port`).
- Use TLS instead of `--insecure` (driftlab's wire format checks the structure of what arrives, not its integrity:
  a flipped bit decodes as another valid value; TLS is what protects the bytes): the SuperLink gets `--ssl-ca-certfile`, `--ssl-certfile` and `--ssl-keyfile`,
  each SuperNode `--root-certificates CA.pem`, and the `[superlink.NAME]` entry of `$FLWR_HOME/config.toml`
  `root-certificates = "CA.pem"` instead of `insecure = true`.
- On each device: `flower-supernode --superlink HOST:PORT --node-config "client-ids='K' state-dir='/var/lib/driftlab'"`,
  and set `load_client_data` in `{PACKAGE}/apps.py` to read the device's own data.
- Keep each node's `state-dir`: besides the client states it holds each client's registration token, which the
  server pins at the client's first registration; a node without it cannot get its clients back in that run, and no
  other node can take them. Add SuperNode authentication (`flower-superlink --enable-supernode-auth`) so that only
  your devices can register at all.
- Restarted nodes re-register and continue from their committed states; `flwr run . NAME -c 'resume=true'`
  continues a run whose server stopped.
"""
    return {
        "pyproject.toml": pyproject,
        "README.md": readme,
        f"{PACKAGE}/__init__.py": "",
        f"{PACKAGE}/apps.py": apps,
        f"{PACKAGE}/{CONFIG_NAME}": json.dumps(config.to_dict(), indent=2) + "\n",
    }


def write_project(directory: str | Path, config: Any, source: str = "", force: bool = False) -> list[Path]:
    """Write the Flower app project for ``config`` into ``directory``; returns the files written.

    ``directory`` is new, or holds none of the project's names but those an earlier project wrote and nobody edited
    since; ``force`` replaces those files whoever wrote or edited them.
    """
    from driftlab.experiments.config import ExperimentConfig, load_config

    if not isinstance(config, ExperimentConfig):
        source = source or str(config)
        config = load_config(config)
    directory = Path(directory).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory} is a file, not a directory: give a new directory for the Flower project")
    from driftlab.deploy.messages import check_config_deployable

    check_config_deployable(config)  # a project that could only fail on the SuperLink is never written
    files = project_files(config, directory, source or config.algorithm.name)
    top = [Path(relative).parts[0] for relative in files]
    owned = claim(directory, top, "driftlab flower new", force=force, another="choose another DIR")
    written = []
    for relative, text in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    owned.record_digests(files)  # the project is meant to be edited: an edited file is the user's from now on
    return written


# ---------------------------------------------------------------- flower check


@dataclass(frozen=True)
class CheckResult:
    rounds: int
    num_nodes: int
    num_parameters: int
    equal: bool
    max_difference: float  # the largest |flower - simulator| over the model's entries (0.0 when equal)
    flower_run: Path | None  # the Flower run's directory, kept when asked for

    def describe(self) -> str:
        verdict = "equal bit for bit" if self.equal else f"DIFFERENT (largest difference {self.max_difference:.3g})"
        return (
            f"after {self.rounds} rounds, the final model of Flower's simulation engine ({self.num_nodes} nodes) and of the "
            f"simulator's sequential backend ({self.num_parameters} parameters): {verdict}"
        )


def check(
    config: Any,
    rounds: int,
    num_nodes: int | None = None,
    keep: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> CheckResult:
    """Run ``config`` (with ``overrides``, ``key=value`` as for ``driftlab run``) for ``rounds`` rounds under Flower's
    simulation engine and under the sequential backend; compare.

    ``num_nodes`` virtual SuperNodes (default: min(4, clients)) serve the clients round-robin.
    ``keep``: a new or empty directory to keep the Flower run's directory in (default: a temporary one, removed).
    What a deployment cannot run is refused before either run starts (``refusal``).
    """
    import torch
    from safetensors.torch import load_file

    from driftlab.experiments.config import load_config
    from driftlab.experiments.run.run_directory import FINAL_MODEL_FILE
    from driftlab.experiments.run.runner import run

    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: give at least 1 round")
    source = str(config) if not hasattr(config, "to_dict") else "CONFIG"
    base = config.to_dict() if hasattr(config, "to_dict") else config
    config = load_config(base, [*overrides, f"rounds={int(rounds)}", 'backend="sequential"'])
    clients = config.data.num_clients
    nodes = num_nodes if num_nodes is not None else min(4, clients)
    if not 1 <= nodes <= clients:
        raise ConfigError(f"--nodes {nodes}: give between 1 and the config's {clients} clients")
    if keep is not None and Path(keep).exists() and (not Path(keep).is_dir() or any(Path(keep).iterdir())):
        raise ConfigError(f"--keep {keep}: give a new or empty directory for the Flower run (nothing is overwritten)")
    problem = refusal(config, source, overrides)
    if problem is not None:
        raise ConfigError(problem)  # before either run starts
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before flwr is imported; the user's own setting wins
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    from driftlab.flower import apps

    expected = run(config).final_params
    work = Path(tempfile.mkdtemp(prefix="driftlab-flower-check-"))
    try:
        out = Path(keep) if keep is not None else work / "flower-run"
        apps.simulate(config, out, num_nodes=nodes, state_dir=work / "node-state", log=_check_log(keep is None))
        final = out / FINAL_MODEL_FILE
        if not final.exists():
            raise RuntimeError(f"the Flower simulation ended without a final model in {out}; its log above says why")
        actual = load_file(str(final))["params"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    expected = expected.detach().cpu()
    same_shape = actual.shape == expected.shape
    equal = same_shape and actual.dtype == expected.dtype and torch.equal(actual, expected)
    difference = (
        0.0 if equal else float((actual.double() - expected.double()).abs().max()) if same_shape else float("inf")
    )
    return CheckResult(
        int(rounds), nodes, int(expected.numel()), bool(equal), difference, Path(keep) if keep is not None else None
    )


def refusal(config: Any, source: str, overrides: Sequence[str] = ()) -> str | None:
    """Why a deployment (so ``driftlab flower check``) cannot run ``config``, with the command that fixes it; None: it can.

    The shipped presets that evaluate a mean of client models (``evaluation.model``) are the usual case: the
    deployment's server never receives client models, so the check runs them with ``evaluation.model=server``.
    """
    from driftlab.deploy.messages import check_config_deployable

    if config.evaluation.model != "server":  # the deployment's own refusal, with the check's command as the fix
        kept = [override for override in overrides if not override.replace(" ", "").startswith("evaluation.model=")]
        command = " ".join(["driftlab flower check", source, *kept, "evaluation.model=server"])
        key = f'evaluation.model = "{config.evaluation.model}"'
        why = (
            f"{source} sets {key}, a mean of client models, which a deployment's server never receives (only the "
            "algorithm's messages travel)"
        )
        return capabilities.refusal(
            key,
            DEPLOYMENT_KEY,
            capabilities.Reason(why, f"check the deployment with the server's model: {command}", "; "),
        )
    try:
        check_config_deployable(config)
    except ConfigError as error:
        return str(error)
    return None


def _check_log(temporary: bool) -> Any:
    """The Flower run's log lines for ``check``: its run directory is not named when it is removed as the check returns."""

    def log(text: str) -> None:
        if temporary and text.startswith("run complete:"):
            text = (
                text.split(" in ", 1)[0]
                + " (in a temporary directory removed when the check ends; --keep DIR keeps it for `driftlab report`)"
            )
        print(f"driftlab: {text}", flush=True)

    return log


# ---------------------------------------------------------------- the command line


def flower_command(args: Any) -> int:
    """``driftlab flower new|check`` (parsed by driftlab.cli): exit 0 done (check: equal), 1 check: different, 2 no Flower."""
    import sys

    if not flower_installed():
        from driftlab.extras import install_hint

        print(
            f"driftlab: error: `driftlab flower` needs Flower, an optional extra of driftlab: {install_hint('flower')}",
            file=sys.stderr,
        )
        return 2
    if args.flower_command == "new":
        written = write_project(args.directory, args.config, force=args.force)
        directory = Path(args.directory)
        print(f"wrote the Flower app project for {args.config} to {directory}:")
        for path in written:
            print(f"  {path.relative_to(directory)}")
        print(
            f"next: the commands in {directory / 'README.md'} (a SuperLink, SuperNodes, then `flwr run {directory} NAME --stream`)"
        )
        return 0
    if args.flower_command == "check":
        result = check(
            args.config,
            args.rounds,
            num_nodes=args.nodes,
            keep=args.keep,
            overrides=getattr(args, "overrides", None) or (),
        )
        print(result.describe())
        if result.flower_run is not None:
            print(f"the Flower run: {result.flower_run}")
        return 0 if result.equal else 1
    raise AssertionError(args.flower_command)
