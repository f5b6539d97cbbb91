"""Every command of README.md runs as written, top to bottom, in a fresh folder, at a small scale.

The ```bash blocks are cut into commands (continued lines joined, a ``for ... done``
loop kept whole, comments dropped, ``a && b`` split in two) and run in order by one
bash process in an empty temporary folder, so a command sees what the ones before it
left (``cd``, ``export``, run directories: an ``--out`` reused by mistake fails here).
To keep the test short, every command that trains gets ``SMALL`` appended:
``rounds=1`` for ``driftlab run`` and ``driftlab demo``, and ``--seeds 0 rounds=1
client.epochs=1`` for ``driftlab sweep`` (``key=value`` overrides may stand anywhere and
win over a sweep's own, ``--scale paper`` included). Nothing else is changed.

``SKIPPED`` lists, by exact text, each command that cannot run here and why (package
installs, downloads, servers that run until stopped, clusters): a README edit that
changes one of them, or adds a command, makes this test fail until someone looks.
``NEEDS_DATA`` lists the commands that read a real data set: they are skipped, with the
reason, where the library does not find that data (a user's machine without it).
The ```python blocks run too, each in a fresh interpreter in the same folder, as written.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

SMALL_RUN = "rounds=1"
SMALL_SWEEP = "--seeds 0 rounds=1 client.epochs=1"

SKIPPED = {
    "pip install torch==2.13.0 -e .": "installs packages: the test runs in the installed checkout",
    'pip install -q torch==2.13.0 -e ".[all,dev]"': "installs packages: the test runs in the installed checkout",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": "installs packages from PyTorch's index, off this machine's network",
    "pip install -e .": "installs packages: the test runs in the installed checkout",
    "pip install -e . \"torch==$(python -c 'import torch; print(torch.__version__)')\"": (
        "installs packages: the test runs in the installed checkout"
    ),
    "python -m pytest -q": "the test suite itself, which holds this test",
    'pip install -e ".[tensorboard]"': "installs packages: every extra is installed for the tests",
    'pip install -e ".[mlflow]"': "installs packages: every extra is installed for the tests",
    'pip install -e ".[wandb]"': "installs packages: every extra is installed for the tests",
    "tensorboard --logdir runs": "a server that runs until stopped",
    "MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri file:runs/fedprox-mlflow/mlruns": "a server that runs until stopped",
    "wandb sync runs/fedprox-wandb/wandb/offline-run-*": "uploads to wandb.ai: needs the network and an account",
    "driftlab sweep fedprox-figure1 --executor slurm --slurm-partition gpu --slurm-time 120 --out runs/fedprox-figure1": (
        "needs a SLURM cluster (sbatch); executors/slurm_test.py runs the SLURM executor locally"
    ),
    "driftlab sweep fedprox-figure1 --executor ray --ray-address auto --out runs/fedprox-figure1": (
        "needs a running Ray cluster; executors/ray_executor_test.py runs the Ray executor"
    ),
    "driftlab data download mnist --to ~/data/mnist": "downloads from the network",
    "flower-superlink --insecure --host 127.0.0.1 --port 9090 &": "a Flower SuperLink, a server that runs until stopped",
    (
        "for i in 0 1 2; do\n"
        "  flower-supernode --insecure --superlink 127.0.0.1:9090 --port 910$i "
        "--node-config \"partition-id=$i num-partitions=3 state-dir='$PWD/node-$i'\" &\n"
        "done"
    ): "Flower SuperNodes, servers that run until stopped",
    "flwr run . loopback --stream": "needs the SuperLink and SuperNodes above; flower/apps_test.py runs a deployment",
    "driftlab report run --out report": "reports the Flower run above, which did not run",
}

NEEDS_DATA = {
    "driftlab run mnist-feddyn data.partition=dirichlet data.dirichlet_alpha=0.3 --out runs/feddyn": "mnist",
    "driftlab run mnist-efl availability.incomplete_probability=0.5 --out runs/efl": "mnist",
    "driftlab sweep feddyn-table2-full --scale paper --out runs/feddyn-paper": "mnist",
    "driftlab data describe mnist-fedavg data.partition=dirichlet data.dirichlet_alpha=0.1": "mnist",
}


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced blocks of ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def without_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` after a blank, outside quotes)."""
    quote = None
    for index, char in enumerate(line):
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def commands(block: str) -> list[str]:
    """The commands of a bash block: continued lines joined, a ``for ... done`` loop whole, ``&&`` chains split."""
    lines: list[str] = []
    for raw in block.splitlines():
        line = without_comment(raw)
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + line.strip()
        elif lines and lines[-1].startswith("for ") and not lines[-1].endswith("done"):
            lines[-1] += "\n" + line
        elif line.strip():
            lines.append(line)
    return [part.strip() for line in lines for part in (line.split(" && ") if "\n" not in line else [line])]


def small(command: str) -> str:
    """``command`` at the test's small scale: ``SMALL_*`` appended where it trains."""
    words = command.split()
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    if words[:2] in (["driftlab", "run"], ["driftlab", "demo"]):
        return f"{command} {SMALL_RUN}"
    if words[:2] == ["driftlab", "sweep"] and "--status" not in words:
        return f"{command} {SMALL_SWEEP}"
    return command


def readme_commands() -> list[str]:
    text = README.read_text()
    return [command for block in code_blocks(text, "bash") for command in commands(block)]


def test_the_commands_are_cut_as_a_shell_reads_them():
    block = 'a --x 1 \\\n  --y "#2" # note\nfor i in 1 2; do\n  b $i &\ndone\nc && d   # e\n# only a comment\n'
    assert commands(block) == ['a --x 1 --y "#2"', "for i in 1 2; do\n  b $i &\ndone", "c", "d"]
    assert small("driftlab run p --out d") == "driftlab run p --out d rounds=1"
    assert small("driftlab sweep s --out d") == "driftlab sweep s --out d --seeds 0 rounds=1 client.epochs=1"
    assert small("driftlab sweep --status d") == "driftlab sweep --status d"
    assert small("driftlab report a --out b") == "driftlab report a --out b"
    assert (
        small("WANDB_MODE=offline driftlab run p --log wandb")
        == "WANDB_MODE=offline driftlab run p --log wandb rounds=1"
    )


@pytest.mark.skipif(not README.exists(), reason="README.md is beside the package only in a source checkout")
def test_every_skipped_command_is_still_in_the_readme():
    found = set(readme_commands())
    assert not set(SKIPPED) - found, f"SKIPPED lists commands the README no longer has: {sorted(set(SKIPPED) - found)}"
    assert not set(NEEDS_DATA) - found, (
        f"NEEDS_DATA lists commands the README no longer has: {sorted(set(NEEDS_DATA) - found)}"
    )


@pytest.mark.slow
@pytest.mark.skipif(not README.exists(), reason="README.md is beside the package only in a source checkout")
@pytest.mark.skipif(
    shutil.which("driftlab") is None or shutil.which("bash") is None, reason="needs bash and the driftlab command"
)
def test_the_readme_commands_run_in_order(tmp_path):
    from driftlab.experiments.run.real_data import real_data_path

    script = ["set -e"]
    for command in readme_commands():
        if command in SKIPPED:
            continue
        if command in NEEDS_DATA and real_data_path(NEEDS_DATA[command]) is None:
            continue
        script += [f"echo {shlex.quote('>>> ' + small(command))}", small(command)]
    env = {**os.environ, "MPLBACKEND": "Agg", "WANDB_SILENT": "true", "PYTHONWARNINGS": "ignore"}
    returncode, stdout, stderr = _run(["bash", "-c", "\n".join(script)], tmp_path, env)
    ran = [line[4:] for line in stdout.splitlines() if line.startswith(">>> ")]
    assert returncode == 0, f"`{ran[-1] if ran else '?'}` exited {returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert (tmp_path / "runs" / "fedprox-tb" / "tensorboard").is_dir() and (
        tmp_path / "scaffold-app" / "pyproject.toml"
    ).is_file()

    for index, block in enumerate(code_blocks(README.read_text(), "python")):
        returncode, stdout, stderr = _run([sys.executable, "-c", block], tmp_path, env)
        assert returncode == 0, f"README python block {index + 1} failed:\n{block}\n{stdout[-2000:]}\n{stderr[-3000:]}"


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 1500) -> tuple[int, str, str]:
    """Run ``command`` in a session of its own, killed whole (sweeps' run processes included) if it outlives ``timeout``."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{command[:2]} ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return process.returncode, stdout, stderr
