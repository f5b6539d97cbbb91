"""Where clients' devices come from: drawn from (seed, client id), or read from a CSV trace.

FedScale (Lai et al., "FedScale: Benchmarking Model and System Performance of Federated Learning at Scale",
ICML 2022) times rounds with measured device traces (compute speed, network bandwidth, availability).  Without a
trace we draw each client's device once, lognormal around medians, as FedScale PR #188 suggests for a synthetic
population:

    speed_k    = speed_median    · exp(σ_s · z_k,1)      samples per second of local training
    download_k = download_median · exp(σ_b · z_k,2)      bits per second, server to client
    upload_k   = upload_median   · exp(σ_b · z_k,3)      bits per second, client to server

with (z_k,1, z_k,2, z_k,3) three standard normals from generator(seed, SYSTEM_PROFILE, 0, k), in that order, so a
client's device depends on (seed, k) alone: not on which clients were asked before it, nor on the run's length.
Such a client is available at every time ([0, ∞)).

A trace (``read_trace``) gives one or more rows per client: speed, download, upload and an availability window
[start, end) in simulated seconds; outside its windows a client is unavailable.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from driftlab.randomness import Stream, generator
from driftlab.simulation.time.plan import DeviceProfile, Profiles

REQUIRED_COLUMNS = ("client", "speed", "download", "upload")
OPTIONAL_COLUMNS = ("start", "end")
TRACE_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
_RATE_COLUMNS = ("speed", "download", "upload")  # positive and finite: a device that never finishes has no row instead
_SHOWN_IDS = 5  # how many missing client ids a message lists
_PROFILE_CACHE = 1 << 17  # lognormal profiles kept (a draw costs a generator's construction, ~20 µs)


@functools.lru_cache(maxsize=_PROFILE_CACHE)
def lognormal_profile(
    seed: int,
    client_id: int,
    speed_median: float,
    speed_sigma: float,
    download_median: float,
    upload_median: float,
    bandwidth_sigma: float,
) -> DeviceProfile:
    """Client ``client_id``'s device: the three lognormal draws of the module docstring (a pure function, cached)."""
    z_speed, z_download, z_upload = generator(seed, Stream.SYSTEM_PROFILE, 0, client_id).standard_normal(3)
    return DeviceProfile(
        speed=speed_median * math.exp(speed_sigma * z_speed),
        download=download_median * math.exp(bandwidth_sigma * z_download),
        upload=upload_median * math.exp(bandwidth_sigma * z_upload),
    )


@dataclass(frozen=True)
class LognormalProfiles:
    """Every client's device drawn once from (seed, client id), lognormal around the medians; always available."""

    seed: int
    speed_median: float = 100.0  # samples per second
    speed_sigma: float = 0.5
    download_median: float = 2e7  # bits per second
    upload_median: float = 5e6  # bits per second
    bandwidth_sigma: float = 0.5

    def __post_init__(self) -> None:
        for name in ("speed_median", "download_median", "upload_median"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        for name in ("speed_sigma", "bandwidth_sigma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number at least 0, got {value}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")

    def profile(self, client_id: int, time: float) -> DeviceProfile:  # noqa: ARG002 - always available: no time matters
        if client_id < 0:
            raise ValueError(f"client ids are 0 or more, got {client_id}")
        return lognormal_profile(
            int(self.seed),
            int(client_id),
            float(self.speed_median),
            float(self.speed_sigma),
            float(self.download_median),
            float(self.upload_median),
            float(self.bandwidth_sigma),
        )

    def available(self, client_ids: np.ndarray, time: float) -> np.ndarray:  # noqa: ARG002 - available at every time
        return np.ones(len(client_ids), dtype=bool)

    def next_start(self, time: float) -> float | None:  # noqa: ARG002 - every client is available at every time
        return None


@dataclass(frozen=True, eq=False)
class TraceProfiles:
    """Devices and availability windows per client, from a trace: row i is client ``client[i]``'s device while
    ``start[i] <= t < end[i]``.  Rows are sorted by (client, start) and one client's windows do not overlap; client k's
    rows are ``offsets[k]:offsets[k + 1]``.  ``source`` and ``sha256`` name the file (run.json records them)."""

    client: np.ndarray  # int64 [rows]
    speed: np.ndarray  # float64 [rows], samples per second
    download: np.ndarray  # float64 [rows], bits per second
    upload: np.ndarray  # float64 [rows], bits per second
    start: np.ndarray  # float64 [rows], seconds
    end: np.ndarray  # float64 [rows], seconds (inf: to the end of the run)
    num_clients: int
    source: str = ""
    sha256: str = ""
    offsets: np.ndarray = field(init=False, repr=False)
    stays: np.ndarray = field(init=False, repr=False)  # float64 [rows]: the end of the stretch of touching windows

    def __post_init__(self) -> None:
        order = np.lexsort((self.start, self.client))
        if np.any(order != np.arange(len(order))):
            raise ValueError("a trace's rows must be sorted by (client, start); read_trace sorts them")
        if len(self.client) and (self.client[0] < 0 or self.client[-1] >= self.num_clients):
            raise ValueError(f"client ids must lie in 0..{self.num_clients - 1}")
        if np.any(self.end <= self.start):
            raise ValueError("every window needs end > start")
        same = self.client[1:] == self.client[:-1]
        if np.any(same & (self.start[1:] < self.end[:-1])):
            raise ValueError("one client's windows must not overlap")
        offsets = np.searchsorted(self.client, np.arange(self.num_clients + 1), side="left")
        object.__setattr__(self, "offsets", offsets)
        # A window followed at once by the client's next (a device whose speed changes at that moment) is one stretch
        # of availability: work begun in it is not lost at the change.  stays[i] is where row i's stretch ends.
        stays = self.end.astype(np.float64, copy=True)
        for row in range(len(stays) - 2, -1, -1):
            if same[row] and self.start[row + 1] == self.end[row]:
                stays[row] = stays[row + 1]
        object.__setattr__(self, "stays", stays)

    def profile(self, client_id: int, time: float) -> DeviceProfile | None:
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client {client_id} is not in the trace's 0..{self.num_clients - 1}")
        first, stop = int(self.offsets[client_id]), int(self.offsets[client_id + 1])
        # the last window that starts at or before t is the only one that can hold it (windows do not overlap)
        row = first + int(np.searchsorted(self.start[first:stop], time, side="right")) - 1
        if row < first or not time < self.end[row]:
            return None
        # end: where the client's availability ends (touching windows are one stretch); the device is this row's for
        # the whole of a piece of work begun now
        return DeviceProfile(
            float(self.speed[row]),
            float(self.download[row]),
            float(self.upload[row]),
            float(self.start[row]),
            float(self.stays[row]),
        )

    def next_start(self, time: float) -> float | None:
        """The earliest window start after ``time`` (None: no window starts later): where a run with nobody available
        at ``time`` goes on."""
        later = self.start[self.start > time]
        return float(later.min()) if len(later) else None

    def available(self, client_ids: np.ndarray, time: float) -> np.ndarray:
        ids = np.asarray(client_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_clients):
            raise ValueError(f"client ids must lie in 0..{self.num_clients - 1}")
        inside = (self.start <= time) & (time < self.end)
        available = np.zeros(self.num_clients, dtype=bool)
        available[self.client[inside]] = True
        return available[ids]


def read_trace(path: str | Path, num_clients: int) -> TraceProfiles:
    """The trace in CSV file ``path`` for a data set of ``num_clients`` clients.

    The first line is a header naming the columns client, speed (samples/s), download, upload (bits/s) and optionally
    start and end (seconds; an absent column or empty cell: 0 and inf).  A ValueError names the file, the line, the
    column and the fix for a value that is not a number, a rate that is not positive and finite, a client id outside
    0..num_clients-1, a window with end <= start, overlapping windows of one client, and data-set clients without a row.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read the trace {path}: {error.strerror or error}; check system.trace") from None
    try:
        text = data.decode("utf-8-sig")  # a spreadsheet's byte-order mark is not part of the first column's name
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}); save the trace as UTF-8 CSV") from None
    reader = csv.reader(io.StringIO(text))
    header = next((row for row in reader if row), None)
    if header is None:
        raise ValueError(
            f"{path} is empty: a trace starts with the header line {','.join(REQUIRED_COLUMNS)}[,start,end]"
        )
    names = [name.strip().lower() for name in header]
    _check_header(path, reader.line_num, names)
    line_numbers = _LineNumbers(text)
    columns = _columns(text, len(names)) if '"' not in text else None
    if columns is None:  # quoted cells, or rows of the wrong length (found again below, for the message)
        rows = [row for row in reader if row]  # csv gives [] for a blank line
        ragged = next((i for i, row in enumerate(rows) if len(row) != len(names)), None)
        if ragged is not None:
            raise ValueError(
                f"{path}, line {line_numbers[ragged]}: {len(rows[ragged])} values for the header's {len(names)} columns "
                f"({','.join(names)}); give one value per column"
            )
        columns = [np.asarray(column, dtype=str) for column in zip(*rows, strict=True)] if rows else []
        del rows
    if not columns or not len(columns[0]):
        raise ValueError(f"{path} has a header but no rows: give each client a row (client, speed, download, upload)")
    cells = dict(zip(names, columns, strict=True))
    client = _client_ids(path, cells["client"], line_numbers, num_clients)
    values = {name: _numbers(path, name, cells[name], line_numbers) for name in _RATE_COLUMNS}
    for name in _RATE_COLUMNS:
        _check(
            path, name, line_numbers, ~(values[name] > 0) | np.isinf(values[name]), "must be a positive finite number"
        )
    start = (
        _numbers(path, "start", cells["start"], line_numbers, empty=0.0) if "start" in cells else np.zeros(len(client))
    )
    end = (
        _numbers(path, "end", cells["end"], line_numbers, empty=math.inf)
        if "end" in cells
        else np.full(len(client), math.inf)
    )
    _check(
        path, "start", line_numbers, ~(start >= 0) | np.isinf(start), "must be a finite number of seconds at least 0"
    )
    _check(path, "end", line_numbers, ~(end > start), "must be larger than start (a window is [start, end))")
    order = np.lexsort((start, client))
    client, start, end = client[order], start[order], end[order]
    values = {name: column[order] for name, column in values.items()}
    overlapping = np.flatnonzero((client[1:] == client[:-1]) & (start[1:] < end[:-1]))
    if len(overlapping):
        i = int(overlapping[0])
        later, earlier = (i + 1, i) if order[i + 1] > order[i] else (i, i + 1)  # named in the order of the file
        raise ValueError(
            f"{path}, line {line_numbers[int(order[later])]}, column 'start': client {client[i]}'s window "
            f"[{start[later]:g}, {end[later]:g}) overlaps its window [{start[earlier]:g}, {end[earlier]:g}) of line "
            f"{line_numbers[int(order[earlier])]}; a client has one device at a time: "
            "make its windows disjoint"
        )
    missing = np.flatnonzero(np.bincount(client, minlength=num_clients) == 0)
    if len(missing):
        shown = ", ".join(str(k) for k in missing[:_SHOWN_IDS]) + (", ..." if len(missing) > _SHOWN_IDS else "")
        raise ValueError(
            f"{path}: {len(missing)} of the data set's {num_clients} clients have no row (client {shown}); give every "
            f"client 0..{num_clients - 1} at least one row"
        )
    return TraceProfiles(
        client,
        values["speed"],
        values["download"],
        values["upload"],
        start,
        end,
        num_clients,
        source=str(path),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def _columns(text: str, width: int) -> list[np.ndarray] | None:
    """The data rows' cells column by column, split in bulk (a CSV text without quotes is plain commas and lines);
    None when a row's length is not ``width``."""
    # csv's line ends; empty lines are blank rows, skipped; the first row is the header
    lines = [line for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n") if line][1:]
    if not lines:
        return []
    if any(line.count(",") != width - 1 for line in lines):
        return None
    return list(np.asarray(",".join(lines).split(","), dtype=str).reshape(len(lines), width).T)


@dataclass(frozen=True)
class _LineNumbers:
    """The line of the i-th data row of a CSV text, found by reading it again: kept for messages only, so a large trace
    is read without a line number per row."""

    text: str

    def __getitem__(self, index: int) -> int:
        reader = csv.reader(io.StringIO(self.text))
        rows = 0
        for row in reader:
            rows += bool(row)
            if rows == index + 2:  # the header, then rows 0..index
                return reader.line_num
        raise IndexError(index)


def _check_header(path: Path, line: int, names: list[str]) -> None:
    unknown = [name for name in names if name not in TRACE_COLUMNS]
    if unknown:
        raise ValueError(
            f"{path}, line {line}: unknown column(s) {', '.join(repr(n) for n in unknown)}; a trace's columns are "
            f"{', '.join(TRACE_COLUMNS)} (start and end optional)"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{path}, line {line}: column(s) {', '.join(repeated)} named twice; name each column once")
    missing = [name for name in REQUIRED_COLUMNS if name not in names]
    if missing:
        raise ValueError(
            f"{path}, line {line}: no column {', '.join(repr(n) for n in missing)}; a trace's header names at least "
            f"{', '.join(REQUIRED_COLUMNS)}"
        )


def _numbers(path: Path, name: str, cells: np.ndarray, lines: _LineNumbers, empty: float | None = None) -> np.ndarray:
    """The column as float64; a ValueError at the first cell that is not a number (NaN included)."""
    strings = np.char.strip(np.asarray(cells, dtype=str))
    blank = strings == ""
    if empty is not None:
        strings = np.where(blank, "nan", strings)
    try:
        values = strings.astype(np.float64)
    except ValueError:
        values = np.array([_float_or_nan(s) for s in strings.tolist()])
    bad = np.isnan(values) & ~blank if empty is not None else np.isnan(values)
    _check(path, name, lines, bad, "is not a number", cells)
    if empty is not None:
        values[blank] = empty
    return values


def _float_or_nan(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _client_ids(path: Path, cells: np.ndarray, lines: _LineNumbers, num_clients: int) -> np.ndarray:
    strings = np.char.strip(np.asarray(cells, dtype=str))
    try:
        ids = strings.astype(np.int64)
    except (ValueError, OverflowError):
        ids = np.array([_int_or_minus_one(s) for s in strings.tolist()], dtype=np.int64)
    _check(
        path,
        "client",
        lines,
        (ids < 0) | (ids >= num_clients),
        f"must be a client id, an integer in 0..{num_clients - 1}",
        cells,
    )
    return ids


def _int_or_minus_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        return -1
    return value if -1 <= value < 2**63 else -1


def _check(path: Path, name: str, lines: _LineNumbers, bad: Any, what: str, cells: np.ndarray | None = None) -> None:
    """A ValueError naming the first bad cell's line and column."""
    rows = np.flatnonzero(bad)
    if len(rows):
        row = int(rows[0])
        given = f" (got {cells[row].strip()[:40]!r})" if cells is not None else ""
        more = f"; {len(rows) - 1} more row(s) like it" if len(rows) > 1 else ""
        raise ValueError(f"{path}, line {lines[row]}, column {name!r}: {what}{given}{more}; fix the trace")


def devices(profiles: Profiles, num_clients: int) -> Iterator[tuple[int, DeviceProfile]]:
    """Every (client, device) a run can meet: each client's lognormal draw, or each row of a trace (a client with
    several windows appears once per window), client by client."""
    if isinstance(profiles, TraceProfiles):
        for row in range(len(profiles.client)):
            yield int(profiles.client[row]), profiles.profile(int(profiles.client[row]), float(profiles.start[row]))
        return
    for client_id in range(num_clients):
        profile = profiles.profile(client_id, 0.0)
        if profile is not None:
            yield client_id, profile


def profiles_for(system: Any, seed: int, num_clients: int) -> Profiles:
    """The ``Profiles`` of a ``[system]`` section (``driftlab.simulation.time.section.SystemConfig``, read by attribute):
    lognormal draws from ``seed``, or the trace ``system.trace`` for ``num_clients`` clients."""
    if system.profiles == "lognormal":
        return LognormalProfiles(
            seed,
            system.speed_median,
            system.speed_sigma,
            system.download_median,
            system.upload_median,
            system.bandwidth_sigma,
        )
    if system.profiles == "trace":
        if not system.trace:
            raise ValueError('profiles = "trace" needs a trace file: set system.trace')
        return read_trace(system.trace, num_clients)
    raise ValueError(f'unknown profiles {system.profiles!r}; valid: "lognormal", "trace"')


__all__ = [
    "LognormalProfiles",
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "TRACE_COLUMNS",
    "TraceProfiles",
    "devices",
    "lognormal_profile",
    "profiles_for",
    "read_trace",
]
