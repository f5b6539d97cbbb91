"""Short runs of every algorithm, with and without compression, on both backends, pinned to a trusted commit's digests.

A refactor must prove it changed nothing: each case below is a 3-round run whose
final server model and per-round metrics (wall times aside) must hash to what the
trusted commit named in ``pinned_runs.json`` gives on the same machine.  The runs are
float64 on one thread, so their bits hold for a fixed machine and torch build
(bit-for-bit repeatability is promised for a fixed thread count and device layout,
not across CPUs): MKL picks its kernels by CPU vendor and instruction set, and the
same code gives other last bits on an AMD and an Intel AVX-512 machine.

So the reference is computed where the test runs:

- on a machine with recorded digests (``machines`` in ``pinned_runs.json``, keyed by
  ``machine_key``: CPU vendor, torch's CPU capability, torch version) those are used;
- on any other machine the trusted commit's own code computes them: its ``driftlab``
  package is exported from git history (``git archive``; the checkout is not touched)
  into a temporary folder and the cases run there in a subprocess, once per machine:
  the digests are cached under ``$DRIFTLAB_PINS_CACHE`` (default
  ``~/.cache/driftlab/pinned-runs``), keyed by commit, machine and cases;
- where the history is not at hand (an sdist, a shallow clone without that commit,
  no git) the comparison is skipped with the reason.

A change that is *meant* to change results says so in two commits.  The first changes
the code and records the new digests of the machine it runs on (other machines'
recorded digests, now stale, are removed), saying which runs moved and why:

    DRIFTLAB_UPDATE_PINS=1 python -m pytest -q driftlab/experiments/pinned_runs_test.py

The second names that first commit as ``trusted_commit``.  A machine may also record
its digests as a fast path, from the trusted commit's code, never from a change under
test: ``DRIFTLAB_UPDATE_PINS=trusted`` records what the trusted commit computes here.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch

import driftlab

PINS = Path(__file__).with_name("pinned_runs.json")
# The tiny synthetic run (8 clients, an MLP of 8 hidden units, float64) of every case; other tests import it to build
# on the run whose bits are pinned here.  It stays a literal in this file: the trusted commit's subprocess imports this
# module over its own, older package, which has no shared test module to import it from.
TINY_RUN = [
    "seed=0",
    "precision=float64",
    "data.name=synthetic",
    "data.num_clients=8",
    "sampling.participation=0.5",
    "model.name=mlp",
    "model.hidden=[8]",
    "client.epochs=1",
    "client.batch_size=10",
    "client.lr=0.05",
]
BASE = ["rounds=3", *TINY_RUN]
CASES: dict[str, list[str]] = {
    "fedavg": ["algorithm.name=fedavg"],
    "fedadam": ["algorithm.name=fedavg", "server.optimizer=adam", "server.lr=0.03"],
    "fedavgm": ["algorithm.name=fedavg", "server.optimizer=momentum", "server.lr=0.5"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.mu=0.1"],
    "scaffold": ["algorithm.name=scaffold"],
    "feddyn": ["algorithm.name=feddyn", "algorithm.alpha=0.01", "evaluation.model=all_clients_mean"],
    "adabest": ["algorithm.name=adabest", "algorithm.mu=0.02", "algorithm.beta=0.9"],
    "efl": ["algorithm.name=efl"],
    "fedavg-compressed": ["algorithm.name=fedavg", "compression.ratio=0.1"],
    "scaffold-compressed-stragglers": [
        "algorithm.name=scaffold",
        "compression.ratio=0.2",
        "availability.incomplete_probability=0.5",
    ],
}
BACKENDS = ("sequential", "vectorized")
KEYS = [f"{case}/{backend}" for case in sorted(CASES) for backend in BACKENDS]


def run_digests(case: str, backend: str) -> dict[str, str]:
    """The sha256 of the final model's bytes and of the metrics (every key but round_seconds, exact float repr)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = driftlab.run(None, overrides=[*BASE, *CASES[case], f"backend={backend}"])
    finally:
        torch.set_num_threads(threads)
    model = result.final_params.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()
    records = [{key: value for key, value in record.items() if key != "round_seconds"} for record in result.records]
    metrics = json.dumps(records, sort_keys=True, allow_nan=False).encode()
    return {"final_model": hashlib.sha256(model).hexdigest(), "metrics": hashlib.sha256(metrics).hexdigest()}


def machine_key() -> str:
    """What decides the last bits of a float64 CPU run besides driftlab: vendor, instruction set, torch build."""
    # imported here, not at the top: the trusted commit's subprocess imports this module over its own, older package
    from driftlab.experiments.run.run_directory import cpu_info

    vendor = cpu_info("vendor_id") or platform.machine() or "unknown"
    return f"{vendor}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"


def _stored() -> dict:
    return json.loads(PINS.read_text())


# ------------------------------------------------------------------ the trusted commit's digests, computed here


class HistoryUnavailable(Exception):
    """The trusted commit's code cannot be had from here; the message says why and what would fix it."""


def _git(checkout: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, check=False, **kwargs)


def export_commit(commit: str, into: Path) -> Path:
    """Write ``commit``'s ``driftlab`` package into ``into`` from the history of the checkout holding this file."""
    checkout = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None:
        raise HistoryUnavailable("git is not installed")
    if _git(checkout, "rev-parse", "--git-dir").returncode != 0:
        raise HistoryUnavailable(f"{checkout} is not a git checkout (an sdist or an installed copy has no history)")
    if _git(checkout, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise HistoryUnavailable(
            f"commit {commit[:12]} is not in this clone's history (a shallow clone? `git fetch --unshallow`)"
        )
    archive = into / "trusted.tar"
    with archive.open("wb") as stream:
        done = subprocess.run(
            ["git", "-C", str(checkout), "archive", "--format=tar", commit, "driftlab"],
            stdout=stream,
            stderr=subprocess.PIPE,
            check=False,
        )
    if done.returncode != 0:
        raise HistoryUnavailable(f"git archive {commit[:12]} failed: {done.stderr.decode(errors='replace').strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(into / "src", filter="data")
    archive.unlink()
    return into / "src"


# Runs in the subprocess: this module's own cases and digest function, over whichever `driftlab` comes first on
# sys.path, which must be the exported commit's (the check below fails loudly rather than pin the checkout to itself).
_CHILD = """
import importlib.util, json, sys
from pathlib import Path
source, module_path = Path(sys.argv[1]).resolve(), sys.argv[2]
spec = importlib.util.spec_from_file_location("_pinned_runs", module_path)
pinned = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pinned)
import driftlab
if source not in Path(driftlab.__file__).resolve().parents:
    sys.exit(f"imported driftlab from {driftlab.__file__}, not from the exported commit in {source}")
print(json.dumps({key: pinned.run_digests(*key.split("/")) for key in pinned.KEYS}))
"""


def trusted_digests(commit: str, cache_dir: Path) -> dict[str, dict[str, str]]:
    """``commit``'s digests of every case on this machine: from the cache, or computed from its exported code."""
    cases = hashlib.sha256(json.dumps([BASE, CASES], sort_keys=True).encode()).hexdigest()[:16]
    machine = hashlib.sha256(machine_key().encode()).hexdigest()[:16]
    cached = cache_dir / f"{commit}-{machine}-{cases}.json"
    if cached.is_file():
        stored = json.loads(cached.read_text())
        if stored.get("machine") == machine_key() and set(stored.get("digests", {})) == set(KEYS):
            return stored["digests"]
    with tempfile.TemporaryDirectory(prefix="driftlab-pins-") as folder:
        source = export_commit(commit, Path(folder))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        env.pop("DRIFTLAB_UPDATE_PINS", None)
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(source), str(Path(__file__).resolve())],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"computing the digests of trusted commit {commit[:12]} failed:\n{done.stderr[-4000:]}")
    digests = json.loads(done.stdout.strip().splitlines()[-1])
    cache_dir.mkdir(parents=True, exist_ok=True)
    temporary = cached.with_name(f".{cached.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps({"commit": commit, "machine": machine_key(), "digests": digests}, indent=1) + "\n")
    os.replace(temporary, cached)
    return digests


def cache_folder() -> Path:
    configured = os.environ.get("DRIFTLAB_PINS_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "driftlab" / "pinned-runs"


# ------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def pins() -> dict[str, dict[str, str]]:
    """The reference digests of this machine: recorded, or computed from the trusted commit; skips without history."""
    stored = _stored()
    update = os.environ.get("DRIFTLAB_UPDATE_PINS")
    recorded = stored["machines"].get(machine_key())
    if update == "trusted" or (not update and not recorded):
        try:
            reference = trusted_digests(stored["trusted_commit"], cache_folder())
        except HistoryUnavailable as why:
            pytest.skip(
                f"no pinned digests for this machine ({machine_key()}) and the trusted commit's code is not at hand: {why}"
            )
        if update == "trusted":
            stored["machines"][machine_key()] = dict(sorted(reference.items()))
            PINS.write_text(json.dumps(stored, indent=1) + "\n")
        yield reference
        return
    machine = {} if update else recorded
    yield machine
    if update:
        # the digests move on purpose: the other machines' are stale, and come back from the next trusted commit
        stored["machines"] = {machine_key(): dict(sorted(machine.items()))}
        PINS.write_text(json.dumps(stored, indent=1) + "\n")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_short_run_matches_its_pinned_digests(case, backend, pins):
    key = f"{case}/{backend}"
    digests = run_digests(case, backend)
    if os.environ.get("DRIFTLAB_UPDATE_PINS") == "1":
        pins[key] = digests
        return
    assert key in pins, f"no pinned digests for {key}; add them with DRIFTLAB_UPDATE_PINS=1"
    assert digests == pins[key], (
        f"{key} no longer gives the trusted commit's final model and metrics on {machine_key()}"
    )


def test_every_case_is_pinned_and_nothing_else():
    stored = _stored()
    assert set(stored) == {"trusted_commit", "why", "machines"} and len(stored["trusted_commit"]) == 40
    assert stored["machines"] and all(set(digests) == set(KEYS) for digests in stored["machines"].values())


def test_the_digest_sees_a_one_ulp_change_of_the_model(monkeypatch):
    """The pin is bit-exact: nudging one weight by one ulp changes the model digest."""
    original = driftlab.run

    def nudged(*args, **kwargs):
        result = original(*args, **kwargs)
        result.final_params = result.final_params.clone()
        result.final_params[0] = torch.nextafter(
            result.final_params[0], torch.tensor(float("inf"), dtype=result.final_params.dtype)
        )
        return result

    plain = run_digests("fedavg", "sequential")
    monkeypatch.setattr(driftlab, "run", nudged)
    changed = run_digests("fedavg", "sequential")
    assert changed["final_model"] != plain["final_model"] and changed["metrics"] == plain["metrics"]


@pytest.mark.slow
def test_the_trusted_commit_computed_here_gives_the_digests_recorded_for_this_machine(tmp_path):
    """The route of a machine nobody recorded, checked where digests are recorded: both must agree bit for bit."""
    stored = _stored()
    recorded = stored["machines"].get(machine_key())
    if recorded is None:
        pytest.skip(f"no digests recorded for this machine ({machine_key()}) to compare the computed ones with")
    try:
        computed = trusted_digests(stored["trusted_commit"], tmp_path / "cache")
    except HistoryUnavailable as why:
        pytest.skip(str(why))
    assert computed == recorded
    # The second call reads the cache: a cache file whose digests were tampered with is what it returns.
    (cached,) = (tmp_path / "cache").iterdir()
    tampered = json.loads(cached.read_text())
    tampered["digests"]["fedavg/sequential"]["final_model"] = "0" * 64
    cached.write_text(json.dumps(tampered))
    assert trusted_digests(stored["trusted_commit"], tmp_path / "cache")["fedavg/sequential"]["final_model"] == "0" * 64


@pytest.fixture
def history() -> None:
    """Skips where this file is not in a git checkout with history (an sdist, an installed copy, no git)."""
    checkout = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or _git(checkout, "rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"{checkout} is not a git checkout")


def test_a_commit_missing_from_the_history_skips_with_the_reason(tmp_path, history):
    with pytest.raises(HistoryUnavailable, match="not in this clone's history"):
        export_commit("0" * 40, tmp_path)


def test_the_exported_commit_is_the_one_imported(tmp_path, history):
    """The exported package shadows the checkout's installed one, so the subprocess really runs the trusted code."""
    try:
        source = export_commit(_stored()["trusted_commit"], tmp_path)
    except HistoryUnavailable as why:
        pytest.skip(str(why))
    env = {**os.environ, "PYTHONPATH": str(source)}
    code = "import driftlab, sys; print(driftlab.__file__)"
    printed = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert Path(printed.strip()).resolve() == (source / "driftlab" / "__init__.py").resolve()
