"""Fuzz and corruption harness for the command line: no traceback, no silent acceptance of nonsense.

Every case is one ``driftlab`` command line run in a forked child (the parent
has already imported driftlab and torch, so a case costs milliseconds rather
than an interpreter start), in its own working directory, with a wall-clock
limit and a resident-memory limit enforced by polling ``/proc``.  A case knows
whether its input is valid (``expect="ok"``) or nonsense (``expect="error"``),
and its outcome is classified as:

* ``ok``          exit 0 on a valid input;
* ``clear-error`` a non-zero exit whose stderr says ``driftlab: error:`` (or is
                  argparse's usage error) and holds no traceback;
* ``traceback``   ``Traceback (most recent call last)`` anywhere in the output;
* ``accepted``    exit 0 on nonsense (a silent acceptance);
* ``refused``     an error on a valid input;
* ``timeout`` / ``memory``  past the wall-clock or the resident-memory limit.

Kinds of cases: hostile overrides (random combinations of bad values for every
kind of key, placed before or after the options), malformed config and sweep
files (binary, non-UTF-8, TOML dates, deep nesting, a 50 MB file of unknown
keys), bad output and resume folders, corrupted run directories (bit flips and
edits of checkpoints and metrics) and corrupted data files (bit flips and
bombs in IDX gzip and image tarballs), plus valid controls of each kind.

Usage:
    python benchmarks/input_fuzz.py                 # 300 fuzzed inputs plus the corruption cases
    python benchmarks/input_fuzz.py --cases 60 --seed 3
    python benchmarks/input_fuzz.py --show traceback,accepted   # print those cases' output

The last line printed is one JSON object with the counts, the peak resident
memory of any rejection, and the failing cases.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# keep_checkpoint: the resume cases edit the checkpoint of the completed two-round run
BASE = [
    "rounds=2",
    "client.epochs=1",
    "data.num_clients=6",
    "sampling.participation=0.5",
    "checkpoint_every=1",
    "keep_checkpoint=true",
]
TRACEBACK = "Traceback (most recent call last)"


@dataclass
class Case:
    name: str
    argv: list[str]
    expect: str  # "ok" or "error"
    setup: Callable[[Path], None] | None = None
    kind: str = "override"


@dataclass
class Outcome:
    case: Case
    verdict: str
    exit_code: int | None
    seconds: float
    peak_rss_mb: float
    stderr_tail: str = ""
    changed_user_files: list[str] = field(default_factory=list)


# --- hostile overrides -----------------------------------------------------------------------------------

BAD_VALUES: dict[str, list[str]] = {
    "rounds": ["true", "-1", "0", "1.5", '"ten"', "10000000000000", "[2]", "nan"],
    "seed": ["true", "1.5", '"a"', "[0]"],
    "client.lr": [
        "0",
        "-1",
        "nan",
        "inf",
        "1e308",
        '"fast"',
        "true",
        '{kind="bogus"}',
        '{kind="exponential", initial=inf, decay=0.9}',
        "1979-05-27",
    ],
    "client.batch_size": ["0", "-5", "1.5", "1000000000", "true"],
    "client.epochs": ["0", "1000000000", "-1", '"x"'],
    "client.steps": ["0", "1000000000000", '{kind="inverse_time", a=inf, b=1}'],
    "client.clip_norm": ["0", "-1", "nan"],
    "client.weight_decay": ["-1", "nan"],
    "data.num_clients": ["0", "1000000000", "-3", "true"],
    "data.root": ['""'],
    "data.name": ['"nope"', "3"],
    "data.dirichlet_alpha": ["0", "-1", "inf"],
    "model.name": ['"nope"', '"lstm"', '"cnn"', '"resnet18_gn"', '"femnist_cnn"', '"quadratic"'],
    "model.hidden": ["[0]", "[-1]", '"x"', "[0, 8]"],
    "sampling.participation": ["0", "1.5", "-0.1", "nan"],
    "sampling.mode": ['"sometimes"'],
    "algorithm.name": ['"nope"', "1"],
    "server.optimizer": ['"lbfgs"'],
    "server.lr": ["-1", "nan", "inf"],
    "availability.events": ["[{round=2, join_range=[5,2]}]", "[{round=-1, leave=[1]}]", '"soon"'],
    "availability.inactive_probability": ["1.5", "-0.5"],
    "evaluation.every": ["0", "-2"],
    "checkpoint_every": ["0", "-1"],
    "device": ['"gpu7"', '"cuda:99"'],
    "precision": ['"float8"'],
    "backend": ['"magic"'],
    "nope": ["1"],
    "client.nope": ["1"],
}
MALFORMED = [
    "client.lr",
    "=3",
    "client.lr=",
    "client.lr=[0.1",
    "client..lr=1",
    ".lr=1",
    "client.lr=0.1=0.2",
    'client.lr="unterminated',
]
GOOD_OVERRIDES = [
    "client.lr=0.05",
    "seed=3",
    "sampling.participation=0.34",
    "algorithm.name=fedprox",
    "algorithm.name=scaffold",
    "server.optimizer=adam",
    "server.lr=0.1",
    "client.batch_size=5",
    "backend=sequential",
    "model.name=mlp",
    "model.hidden=[8]",
]


def override_cases(rng: random.Random, count: int) -> list[Case]:
    cases = []
    keys = sorted(BAD_VALUES)
    for index in range(count):
        roll = rng.random()
        if roll < 0.15:
            bad = [rng.choice(MALFORMED)]
        elif roll < 0.25:
            bad = []
        else:
            bad = [f"{key}={rng.choice(BAD_VALUES[key])}" for key in rng.sample(keys, rng.choice((1, 1, 2, 3)))]
        command = rng.choice(("run", "run", "config", "sweep"))
        if command != "run":
            # `config` resolves and `sweep --dry-run` plans: neither builds a model, so a model that does not
            # fit the data is found when the run starts, not here.
            # Nor can they know the devices and memory of the machine a run will start on (a sweep may go to a
            # cluster): sizes checked against the machine's memory are checked where the run starts.
            machine_dependent = (
                "device=",
                "client.epochs=1000000000",
                "client.steps=1000000000000",
                "data.num_clients=1000000000",
            )
            bad = [
                b
                for b in bad
                if not (b.startswith("model.name=") and b != 'model.name="nope"')
                and not b.startswith(machine_dependent)
            ]
        good = rng.sample(GOOD_OVERRIDES, rng.choice((0, 1, 2)))
        if command == "sweep":
            good = [g for g in good if not g.startswith("seed=")]  # a sweep takes its seeds from --seeds
        if sum(g.startswith("algorithm.name") for g in good) > 1:
            good = [g for g in good if not g.startswith("algorithm.name")][:1]
        # A later assignment of a key wins, so a base or good value must not undo a bad one.
        bad_keys = {b.split("=", 1)[0] for b in bad}
        overrides = [o for o in [*BASE, *good] if o.split("=", 1)[0] not in bad_keys] + bad
        rng.shuffle(overrides)
        split = rng.randrange(len(overrides) + 1)
        if command == "run":
            argv = ["run", "synthetic-fedavg", *overrides[:split], "--out", "out", "--quiet", *overrides[split:]]
        elif command == "config":
            argv = ["config", "synthetic-fedavg", *overrides]
        else:
            argv = [
                "sweep",
                "synthetic-fedavg",
                *overrides[:split],
                "--grid",
                "client.lr=[0.05, 0.1]",
                "--jobs",
                "1",
                "--no-report",
                "--dry-run",
                "--out",
                "sw",
                *overrides[split:],
            ]
        cases.append(Case(f"overrides-{index}:{command}", argv, "error" if bad else "ok"))
    return cases


# --- files ---------------------------------------------------------------------------------------------


def _writer(name: str, content: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes(content)


def file_cases() -> list[Case]:
    deep = "x = " + "[" * 1000 + "]" * 1000 + "\n"
    nested_tables = "".join(f"[{'.'.join(['a'] * depth)}]\n" for depth in range(1, 60))
    huge = b"".join(b"unknown_key_%d = 1\n" % i for i in range(2_800_000))  # about 50 MB
    valid = b'base = "synthetic-fedavg"\nrounds = 2\n[client]\nepochs = 1\n[data]\nnum_clients = 6\n[sampling]\nparticipation = 0.5\n'
    run = lambda name: ["run", name, "--out", "out", "--quiet"]  # noqa: E731
    cases = [
        Case("file:binary", run("c.toml"), "error", _writer("c.toml", bytes(range(256)) * 8), "file"),
        Case(
            "file:non-utf8",
            run("c.toml"),
            "error",
            _writer("c.toml", "rounds = 2\n# caf\u00e9\n".encode("latin-1")),
            "file",
        ),
        Case(
            "file:date", run("c.toml"), "error", _writer("c.toml", b"rounds = 2\n[client]\nlr = 1979-05-27\n"), "file"
        ),
        Case("file:deep-arrays", run("c.toml"), "error", _writer("c.toml", deep.encode()), "file"),
        Case("file:deep-tables", run("c.toml"), "error", _writer("c.toml", nested_tables.encode()), "file"),
        Case("file:50MB-unknown-keys", run("c.toml"), "error", _writer("c.toml", huge), "file"),
        Case("file:json-garbage", run("c.json"), "error", _writer("c.json", b'{"rounds": 2,,}'), "file"),
        Case("file:json-list", run("c.json"), "error", _writer("c.json", b"[1, 2, 3]"), "file"),
        Case("file:empty", run("c.toml"), "ok", _writer("c.toml", b""), "file"),
        Case("file:missing", run("absent.toml"), "error", None, "file"),
        Case("file:a-directory", run("folder.toml"), "error", lambda f: (f / "folder.toml").mkdir(), "file"),
        Case("file:base-preset", run("c.toml"), "ok", _writer("c.toml", valid), "file"),
        Case(
            "file:base-cycle",
            run("a.toml"),
            "error",
            lambda f: ((f / "a.toml").write_text('base = "b.toml"\n'), (f / "b.toml").write_text('base = "a.toml"\n')),
            "file",
        ),
        Case("file:base-missing", run("c.toml"), "error", _writer("c.toml", b'base = "no-such-preset"\n'), "file"),
        Case(
            "sweep:unclosed-bracket",
            ["sweep", "synthetic-fedavg", "--grid", "client.lr=[0.1, 0.2", "--dry-run", "--out", "sw"],
            "error",
            None,
            "file",
        ),
        Case(
            "sweep:duplicate-values",
            ["sweep", "synthetic-fedavg", "--grid", "client.lr=0.1,0.1", "--dry-run", "--out", "sw"],
            "error",
            None,
            "file",
        ),
        Case(
            "sweep:empty-values",
            ["sweep", "synthetic-fedavg", "--grid", "client.lr=", "--dry-run", "--out", "sw"],
            "error",
            None,
            "file",
        ),
        Case(
            "sweep:no-equals",
            ["sweep", "synthetic-fedavg", "--grid", "client.lr", "--dry-run", "--out", "sw"],
            "error",
            None,
            "file",
        ),
        Case(
            "sweep:unknown-key",
            ["sweep", "synthetic-fedavg", "--grid", "client.nope=1,2", "--dry-run", "--out", "sw"],
            "error",
            None,
            "file",
        ),
        Case(
            "sweep:override-after-grid",
            ["sweep", "synthetic-fedavg", "--grid", "client.lr=0.1,0.2", "rounds=6", "--dry-run", "--out", "sw"],
            "ok",
            None,
            "file",
        ),
        Case(
            "sweep:bad-seeds",
            ["sweep", "synthetic-fedavg", "--seeds", "0,x", "--dry-run", "--out", "sw"],
            "error",
            None,
            "file",
        ),
        Case(
            "sweep:binary-file",
            ["sweep", "s.toml", "--dry-run", "--out", "sw"],
            "error",
            _writer("s.toml", bytes(range(256))),
            "file",
        ),
    ]
    return cases


# --- output and resume folders ---------------------------------------------------------------------------


def folder_cases(finished_run: Path) -> list[Case]:
    run = ["run", "synthetic-fedavg", *BASE, "--quiet"]

    def copy_run(folder: Path) -> None:
        shutil.copytree(finished_run, folder / "out")

    def edit(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
        def setup(folder: Path) -> None:
            copy_run(folder)
            mutate(folder / "out")

        return setup

    def flip_checkpoint_bit(out: Path) -> None:
        path = out / "checkpoint.safetensors"
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10
        path.write_bytes(bytes(data))

    def rewrite_checkpoint(out: Path, tensors_change=None, metadata_change=None) -> None:
        from safetensors import safe_open
        from safetensors.torch import save_file

        path = out / "checkpoint.safetensors"
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        if tensors_change:
            tensors = tensors_change(tensors)
        if metadata_change:
            metadata_change(metadata)
        save_file(tensors, str(path), metadata=metadata)

    def to_half(tensors):
        return {k: (v.half().float() if v.is_floating_point() else v) for k, v in tensors.items()}

    def metrics_lines(out: Path, change: Callable[[list[str]], list[str]]) -> None:
        path = out / "metrics.jsonl"
        path.write_text("".join(line + "\n" for line in change(path.read_text().splitlines())))

    resume = [*run, "--out", "out", "--resume", "rounds=3"]
    return [
        Case("out:empty-string", [*run, "--out", ""], "error", None, "folder"),
        Case("out:dev-null", [*run, "--out", "/dev/null"], "error", None, "folder"),
        Case("out:a-file", [*run, "--out", "f.txt"], "error", _writer("f.txt", b"mine\n"), "folder"),
        Case(
            "out:user-folder",
            [*run, "--out", "mine"],
            "error",
            lambda f: (
                (f / "mine").mkdir(),
                (f / "mine" / "config.json").write_text('{"mine": true}\n'),
                (f / "mine" / "notes.txt").write_text("x"),
            ),
            "folder",
        ),
        Case("out:new-folder", [*run, "--out", "fresh/nested"], "ok", None, "folder"),
        Case("out:existing-run-no-resume", [*run, "--out", "out"], "error", copy_run, "folder"),
        Case(
            "resume:empty-folder",
            [*run, "--out", "empty", "--resume"],
            "error",
            lambda f: (f / "empty").mkdir(),
            "folder",
        ),
        Case("resume:no-folder", [*run, "--out", "absent", "--resume"], "error", None, "folder"),
        Case(
            "resume:garbage-config",
            resume,
            "error",
            edit(lambda o: (o / "config.json").write_bytes(b"\x00\xffgarbage")),
            "folder",
        ),
        Case(
            "resume:foreign-config",
            resume,
            "error",
            edit(lambda o: (o / "config.json").write_text('{"model_name": "x", "fields": {"a": 1}}')),
            "folder",
        ),
        Case("resume:good", resume, "ok", copy_run, "folder"),
        Case(
            "resume:config-json",
            ["run", "out/config.json", "--out", "out", "--resume", "rounds=3", "--quiet"],
            "ok",
            copy_run,
            "folder",
        ),
        Case("resume:checkpoint-bit-flip", resume, "error", edit(flip_checkpoint_bit), "folder"),
        Case(
            "resume:checkpoint-float16",
            resume,
            "error",
            edit(lambda o: rewrite_checkpoint(o, tensors_change=to_half)),
            "folder",
        ),
        Case(
            "resume:checkpoint-stale-round",
            resume,
            "error",
            edit(lambda o: rewrite_checkpoint(o, metadata_change=lambda m: m.update(round="1"))),
            "folder",
        ),
        Case(
            "resume:checkpoint-negative-round",
            resume,
            "error",
            edit(lambda o: rewrite_checkpoint(o, metadata_change=lambda m: m.update(round="-3"))),
            "folder",
        ),
        Case(
            "resume:checkpoint-truncated",
            resume,
            "error",
            edit(
                lambda o: (o / "checkpoint.safetensors").write_bytes((o / "checkpoint.safetensors").read_bytes()[:100])
            ),
            "folder",
        ),
        Case(
            "resume:metrics-garbage-middle",
            resume,
            "error",
            edit(lambda o: metrics_lines(o, lambda ls: [ls[0], "garbage{", *ls[1:]])),
            "folder",
        ),
        Case("resume:metrics-deleted", resume, "error", edit(lambda o: (o / "metrics.jsonl").unlink()), "folder"),
        Case(
            "resume:metrics-null-last",
            resume,
            "error",
            edit(lambda o: metrics_lines(o, lambda ls: [*ls[:-1], "null"])),
            "folder",
        ),
        Case(
            "resume:metrics-empty-object-last",
            resume,
            "error",
            edit(lambda o: metrics_lines(o, lambda ls: [*ls[:-1], "{}"])),
            "folder",
        ),
        # A kill while the record after the checkpoint was being appended: that line is torn.
        Case(
            "resume:metrics-torn-last",
            resume,
            "ok",
            edit(lambda o: metrics_lines(o, lambda ls: [*ls, '{"round": 3, "selec'])),
            "folder",
        ),
        # The checkpoint's own round torn cannot come from a kill (the record is written before the checkpoint).
        Case(
            "resume:metrics-checkpoint-round-torn",
            resume,
            "error",
            edit(lambda o: (o / "metrics.jsonl").write_text((o / "metrics.jsonl").read_text()[:-20])),
            "folder",
        ),
    ]


# --- data files ----------------------------------------------------------------------------------------


def _idx(images, labels) -> tuple[bytes, bytes]:
    import numpy as np

    count = len(labels)
    image_bytes = struct.pack(">IIII", 0x803, count, 28, 28) + np.asarray(images, dtype=np.uint8).tobytes()
    label_bytes = struct.pack(">II", 0x801, count) + np.asarray(labels, dtype=np.uint8).tobytes()
    return gzip.compress(image_bytes, mtime=0), gzip.compress(label_bytes, mtime=0)


def _write_mnist(folder: Path, flip: str | None = None, bomb: bool = False) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 120), ("t10k", 40)):
        images, labels = _idx(rng.integers(0, 255, (count, 28, 28)), np.arange(count) % 10)
        if flip == split:
            images = bytearray(images)
            images[len(images) // 2] ^= 0x01
            images = bytes(images)
        (folder / f"{split}-images-idx3-ubyte.gz").write_bytes(images)
        (folder / f"{split}-labels-idx1-ubyte.gz").write_bytes(labels)
    if bomb:
        # A header that declares 10^6 images, then 2 GB of zeros: a few MB compressed.
        with gzip.open(folder / "train-images-idx3-ubyte.gz", "wb", compresslevel=9) as handle:
            handle.write(struct.pack(">IIII", 0x803, 2_600_000, 28, 28))
            zeros = bytes(1 << 24)
            for _ in range(128):
                handle.write(zeros)


def _write_cifar_tarball(path: Path, flip: bool = False, giant_png: bool = False) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
        for split, per_class in (("train", 6), ("test", 2)):
            for label, name in enumerate(classes):
                for index in range(per_class):
                    image = Image.new("RGB", (32, 32), (label * 20, index * 30, 100))
                    data = io.BytesIO()
                    image.save(data, format="JPEG", quality=75)
                    member = tarfile.TarInfo(f"c10/{split}/{name}/{index:04d}.jpg")
                    member.size = len(data.getvalue())
                    archive.addfile(member, io.BytesIO(data.getvalue()))
        if giant_png:
            image = Image.new("L", (20000, 20000))
            data = io.BytesIO()
            image.save(data, format="PNG")
            member = tarfile.TarInfo("c10/train/cat/9999.jpg")
            member.size = len(data.getvalue())
            archive.addfile(member, io.BytesIO(data.getvalue()))
    content = bytearray(buffer.getvalue())
    if flip:
        content[len(content) // 2] ^= 0x04
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(content))


def data_cases() -> list[Case]:
    mnist = ["run", "mnist-fedavg", *BASE, "model.name=mlr", "data.root=mnist", "--out", "out", "--quiet"]
    cifar = [
        "run",
        "synthetic-fedavg",
        *BASE,
        "data.name=cifar10_folder",
        "model.name=cnn",
        "data.root=c10.tar.gz",
        "--out",
        "out",
        "--quiet",
    ]
    return [
        Case("data:mnist-good", mnist, "ok", lambda f: _write_mnist(f / "mnist"), "data"),
        Case("data:mnist-bit-flip-train", mnist, "error", lambda f: _write_mnist(f / "mnist", flip="train"), "data"),
        Case("data:mnist-bit-flip-test", mnist, "error", lambda f: _write_mnist(f / "mnist", flip="t10k"), "data"),
        Case("data:mnist-gzip-bomb", mnist, "error", lambda f: _write_mnist(f / "mnist", bomb=True), "data"),
        Case("data:mnist-missing", mnist, "error", None, "data"),
        Case("data:cifar-good", cifar, "ok", lambda f: _write_cifar_tarball(f / "c10.tar.gz"), "data"),
        Case(
            "data:cifar-bit-flip", cifar, "error", lambda f: _write_cifar_tarball(f / "c10.tar.gz", flip=True), "data"
        ),
        Case(
            "data:cifar-giant-png",
            cifar,
            "error",
            lambda f: _write_cifar_tarball(f / "c10.tar.gz", giant_png=True),
            "data",
        ),
        Case("data:cifar-not-gzip", cifar, "error", _writer("c10.tar.gz", b"this is not an archive" * 100), "data"),
    ]


# --- running a case -------------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and p.stat().st_size < 5_000_000
    }


def run_case(case: Case, workdir: Path, timeout: float, memory_limit_mb: float) -> Outcome:
    from driftlab.cli import main

    folder = workdir / case.name.replace(":", "_").replace("/", "_")
    folder.mkdir(parents=True)
    if case.setup is not None:
        case.setup(folder)
    # The user's own files (anything set up that is not a driftlab run folder) must come out unchanged.
    protected = {k: v for k, v in _snapshot(folder).items() if not k.startswith("out/")}
    stdout_path, stderr_path = folder / ".stdout", folder / ".stderr"
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child
        code = 98
        try:
            os.chdir(folder)
            os.setsid()
            with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            try:
                code = main(case.argv)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
            except BaseException:  # noqa: BLE001 - what escapes main is exactly what this harness looks for
                import traceback

                traceback.print_exc()
                code = 99
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 97)
    verdict = None
    peak_kb = 0
    while True:
        waited, status, usage = os.wait4(pid, os.WNOHANG)
        if waited == pid:
            peak_kb = max(peak_kb, usage.ru_maxrss)
            break
        try:
            with open(f"/proc/{pid}/statm") as handle:
                resident_pages = int(handle.read().split()[1])
            rss_mb = resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
            peak_kb = max(peak_kb, int(rss_mb * 1024))
            if rss_mb > memory_limit_mb:
                verdict = "memory"
        except (OSError, ValueError, IndexError):
            pass
        if time.perf_counter() - started > timeout:
            verdict = "timeout"
        if verdict is not None:
            os.killpg(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.02)
    seconds = time.perf_counter() - started
    exit_code = os.waitstatus_to_exitcode(status)
    stderr = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
    stdout = stdout_path.read_text(errors="replace") if stdout_path.exists() else ""
    if verdict is None:
        if TRACEBACK in stderr or TRACEBACK in stdout or exit_code == 99:
            verdict = "traceback"
        elif exit_code == 0:
            verdict = "ok" if case.expect == "ok" else "accepted"
        elif case.expect == "ok":
            verdict = "refused"
        elif "driftlab: error:" in stderr or "usage: driftlab" in stderr:
            verdict = "clear-error"
        else:
            verdict = "unclear-error"
    after = _snapshot(folder)
    changed = sorted(k for k, v in protected.items() if after.get(k) != v)
    if changed and verdict in ("clear-error", "ok"):
        verdict = "changed-user-files"
    return Outcome(case, verdict, exit_code, seconds, peak_kb / 1024, stderr[-600:], changed)


def make_finished_run(workdir: Path) -> Path:
    from driftlab.cli import main

    out = workdir / "finished-run"
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            code = main(["run", "synthetic-fedavg", *BASE, "--out", str(out), "--quiet"])
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code or 0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("could not make the reference run for the resume cases")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", type=int, default=300, help="fuzzed override cases (the file, folder and data cases come on top)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    parser.add_argument(
        "--memory-limit-mb", type=float, default=3000.0, help="a case past this resident memory is killed and counted"
    )
    parser.add_argument("--kinds", default="override,file,folder,data")
    parser.add_argument(
        "--show",
        default="traceback,accepted,refused,unclear-error,timeout,memory,changed-user-files",
        help="verdicts whose cases are printed with their stderr",
    )
    args = parser.parse_args(argv)

    import torch  # noqa: F401  - imported before forking so every case starts warm

    import driftlab.cli
    import driftlab.experiments.run.runner  # noqa: F401

    kinds = set(args.kinds.split(","))
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="driftlab-fuzz-"))
    try:
        cases: list[Case] = []
        if "override" in kinds:
            cases += override_cases(rng, args.cases)
        if "file" in kinds:
            cases += file_cases()
        if "folder" in kinds:
            cases += folder_cases(make_finished_run(workdir))
        if "data" in kinds:
            cases += data_cases()
        outcomes = []
        for number, case in enumerate(cases, 1):
            outcome = run_case(case, workdir, args.timeout, args.memory_limit_mb)
            outcomes.append(outcome)
            print(
                f"[{number:3d}/{len(cases)}] {outcome.verdict:18s} exit={outcome.exit_code!s:4s} {outcome.seconds:6.2f}s "
                f"{outcome.peak_rss_mb:7.0f} MB  {case.name}",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    show = set(args.show.split(","))
    for outcome in outcomes:
        if outcome.verdict in show:
            print(f"\n--- {outcome.verdict}: {outcome.case.name}\n    argv: {outcome.case.argv}\n{outcome.stderr_tail}")
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
    rejections = [o for o in outcomes if o.case.expect == "error" and o.verdict != "memory"]
    summary = {
        "cases": len(outcomes),
        "fuzzed_override_cases": sum(o.case.kind == "override" for o in outcomes),
        "counts": counts,
        "tracebacks": counts.get("traceback", 0),
        "silent_acceptances": counts.get("accepted", 0),
        "peak_rss_mb_while_rejecting": max((o.peak_rss_mb for o in rejections), default=0.0),
        "median_seconds_per_case": sorted(o.seconds for o in outcomes)[len(outcomes) // 2] if outcomes else 0.0,
        "failing": [f"{o.verdict}: {o.case.name}" for o in outcomes if o.verdict not in ("ok", "clear-error")],
        "parent_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print("\n" + " ".join(f"{verdict}={n}" for verdict, n in sorted(counts.items())))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
