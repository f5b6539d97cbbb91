"""Accounting time per round of a private run: ε after rounds 1, 2, ..., T, as a run asks for it (issue 27).

A run with ``privacy.delta`` reports ε after every round
(``accounting.run_epsilon(settings, t)``).  This script asks
``driftlab.privacy.accounting.epsilon`` for T = 1 .. ``--rounds`` (default
1,000) in order, with the caches empty at the start, for each accountant and
each workload:

* ``central_q0.01`` — central noise, q = 0.01 (10 of 1,000 clients per round), z = 1.0;
* ``central_q0.1`` — central noise, q = 0.1 (100 of 1,000 clients per round), z = 1.1;
* ``local`` — local noise, z = 8.0 (``local_epsilon``: q = 1, multiplier z/2).

Per row: the first call's seconds (RDP: the per-round RDP vector, computed
once per (q, z); PRV: one full PRV), the median, 95th percentile and largest
later call, the total over all rounds, and ε after the last round.  Also the
seconds to import Opacus (once per process, on the first ε) and to find the
noise multiplier for a target ε (``noise_multiplier_for``).  The last line
printed is one JSON object with every number.

Usage:
    python benchmarks/privacy_accounting.py            # 1,000 rounds (RDP: a second; PRV: about three minutes)
    python benchmarks/privacy_accounting.py --quick    # 20 rounds, a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the driftlab of this checkout

from driftlab.privacy import accounting

DELTA = 1e-5
WORKLOADS = {  # name: (noise multiplier z, sampling rate q, local noise)
    "central_q0.01": (1.0, 0.01, False),
    "central_q0.1": (1.1, 0.1, False),
    "local": (8.0, 1.0, True),
}


def _clear_caches() -> None:
    for cached in (accounting._rdp_per_round, accounting._rdp_epsilon, accounting._prv_epsilon):
        cached.cache_clear()


def time_rounds(z: float, q: float, local: bool, rounds: int, accountant: str) -> dict:
    """Seconds of each ε query for T = 1 .. rounds, caches empty at the start."""
    _clear_caches()
    seconds, eps = [], None
    for t in range(1, rounds + 1):
        start = time.perf_counter()
        if local:
            eps = accounting.local_epsilon(z, t, DELTA, accountant)
        else:
            eps = accounting.epsilon(z, q, t, DELTA, accountant)
        seconds.append(time.perf_counter() - start)
    later = sorted(seconds[1:]) or [0.0]
    return {
        "first_seconds": seconds[0],
        "median_seconds": statistics.median(later),
        "p95_seconds": later[int(0.95 * (len(later) - 1))],
        "max_seconds": later[-1],
        "total_seconds": sum(seconds),
        "epsilon_last": eps,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="20 rounds")
    args = parser.parse_args(argv)
    rounds = 20 if args.quick else args.rounds

    start = time.perf_counter()
    accounting._opacus_rdp()
    accounting._opacus_prv()
    import_seconds = time.perf_counter() - start

    results = []
    for accountant in ("rdp", "prv"):
        for name, (z, q, local) in WORKLOADS.items():
            row = {"accountant": accountant, "workload": name, "z": z, "q": q, "local": local}
            row |= time_rounds(z, q, local, rounds, accountant)
            results.append(row)
            print(
                f"{accountant} {name:14s} first {row['first_seconds'] * 1e3:8.2f} ms  median "
                f"{row['median_seconds'] * 1e3:8.3f} ms  p95 {row['p95_seconds'] * 1e3:8.3f} ms  total "
                f"{row['total_seconds']:7.2f} s  ε({rounds}) = {row['epsilon_last']:.4g}",
                flush=True,
            )
    calibration = []
    for accountant in ("rdp", "prv"):
        _clear_caches()
        start = time.perf_counter()
        z = accounting.noise_multiplier_for(1.0, DELTA, 0.01, rounds, accountant)
        calibration.append(
            {
                "accountant": accountant,
                "target_epsilon": 1.0,
                "q": 0.01,
                "rounds": rounds,
                "noise_multiplier": z,
                "seconds": time.perf_counter() - start,
            }
        )
    report = {
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
        "workload": {"rounds": rounds, "delta": DELTA},
        "opacus_import_seconds": import_seconds,
        "results": results,
        "noise_multiplier_for": calibration,
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
