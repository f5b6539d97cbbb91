"""The deployment server's ROUNDS_FILE (``deployment_rounds.json`` in the run directory): what a restarted server
needs to resume with the nodes (``driftlab.deploy.server`` module docstring), read back checked and written atomically.

It holds the run id, each client's registered sample count, the SHA-256 of each client's registration token (the
digest only: the file proves nothing), the reply tensors' scales (``reply_checks.out_of_bounds``) and, per round,
the clients whose replies the server aggregated.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from pathlib import Path

import numpy as np

from driftlab.deploy.messages import RUN_ID
from driftlab.errors import ConfigError
from driftlab.simulation.state.checkpoint import write_atomically

ROUNDS_FILE = "deployment_rounds.json"  # per round, the clients whose replies the server accepted
_DIGEST = re.compile(r"[0-9a-f]{64}")  # a registration token's SHA-256, as ROUNDS_FILE keeps it


def read_rounds(
    out: Path, up_to_round: int, num_clients: int
) -> tuple[dict[int, list[int]], str, np.ndarray, dict[int, str], dict[str, float]]:
    """ROUNDS_FILE's accepted clients per round, run id, registered sample counts, pinned token digests (SHA-256)
    and the reply tensors' scales (``out_of_bounds``); a fresh start makes a new run id."""
    path = out / ROUNDS_FILE
    if up_to_round == 0:
        return {}, uuid.uuid4().hex, np.full(num_clients, -1, dtype=np.int64), {}, {}
    if not path.exists():
        raise ConfigError(
            f"cannot resume the deployment in {out}: {ROUNDS_FILE} is missing, so the nodes' client states cannot be matched"
        )
    try:
        saved = json.loads(path.read_text())
        table = {
            int(round_index): [int(client_id) for client_id in clients]
            for round_index, clients in saved["accepted"].items()
        }
        run_id = str(saved["run_id"])
        sizes = np.array([int(count) for count in saved["num_samples"]], dtype=np.int64)
        if not RUN_ID.fullmatch(run_id) or sizes.shape != (num_clients,):
            raise ValueError(f"run id {run_id!r} and {len(sizes)} sample counts for {num_clients} clients")
        # A file written before tokens existed has none: its clients' tokens are pinned at their next registration.
        tokens = {int(client_id): str(digest) for client_id, digest in saved.get("token_sha256", {}).items()}
        if any(
            not 0 <= client_id < num_clients or not _DIGEST.fullmatch(digest) for client_id, digest in tokens.items()
        ):
            raise ValueError("a token digest that is not a client's SHA-256")
        # Scales as of the last round written: a resume from an older checkpoint goes on from those (a looser bound, never a tighter one).
        scales = {str(name): float(value) for name, value in saved.get("reply_scales", {}).items()}
        if any(not (math.isfinite(value) and value >= 0) for value in scales.values()):
            raise ValueError("a reply scale that is not a finite distance")
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        raise ConfigError(
            f"{path} is damaged ({error}); it holds the run id, the clients' registered sample counts "
            "and the clients whose replies each round aggregated"
        ) from None
    return (
        {round_index: clients for round_index, clients in table.items() if round_index <= up_to_round},
        run_id,
        sizes,
        tokens,
        scales,
    )


def write_rounds(
    out: Path,
    run_id: str,
    sizes: np.ndarray,
    tokens: dict[int, str],
    scales: dict[str, float],
    accepted: dict[int, list[int]],
) -> None:
    """ROUNDS_FILE in ``out``, written atomically: the run id, the registered sample counts, the pinned token
    digests, the reply tensors' scales and the clients whose replies each round aggregated."""
    text = json.dumps(
        {
            "run_id": run_id,
            "num_samples": sizes.tolist(),
            "token_sha256": {
                str(client_id): digest for client_id, digest in sorted(tokens.items())
            },  # digests only: the file proves nothing
            "reply_scales": dict(sorted(scales.items())),
            "accepted": {str(round_index): clients for round_index, clients in sorted(accepted.items())},
        }
    )
    write_atomically(out / ROUNDS_FILE, lambda temporary: temporary.write_text(text))
