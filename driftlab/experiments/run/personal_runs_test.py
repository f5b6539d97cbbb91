"""Personalized models survive a kill: a run killed between checkpoints and resumed equals the run made straight,
its personal columns and every client's personal state included (APFL's v_k and α_k, Ditto's v_k, FedAMP's w_k)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.experiments.run.testing import RESUMABLE_RUN, run_records, without_wall_time

TINY = [*RESUMABLE_RUN, "keep_checkpoint=true"]
CASES = {
    "apfl": ["algorithm.name=apfl"],
    "ditto": ["algorithm.name=ditto", "algorithm.lam=0.5"],
    "fedamp": ["algorithm.name=fedamp"],
    "fedamp-disk": ["algorithm.name=fedamp", "state.store=disk"],
    "finetune": ["algorithm.name=fedavg", "evaluation.finetune_steps=2"],
}


def _records(out: Path) -> list[dict]:
    return without_wall_time(run_records(out))


@pytest.mark.parametrize("case", list(CASES))
def test_a_personalized_run_killed_between_checkpoints_resumes_exactly(tmp_path, case):
    overrides = [*TINY, *CASES[case]]
    straight = tmp_path / "straight"
    driftlab.run(None, straight, overrides=overrides)
    out, killed = tmp_path / "run", tmp_path / "killed"

    def snapshot(record):  # the directory as a SIGKILL right after round 5 leaves it (checkpoint at round 4)
        if record["round"] == 5:
            shutil.copytree(out, killed)

    driftlab.run(None, out, overrides=overrides, progress=snapshot)
    driftlab.run(None, killed, resume=True, overrides=overrides)
    assert _records(killed) == _records(straight)
    assert all("personal_test_accuracy_mean" in record for record in _records(straight))
    a, b = load_file(str(straight / "checkpoint.safetensors")), load_file(str(killed / "checkpoint.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    if case != "finetune":
        assert (
            any(key.startswith("client/") for key in a) or case == "fedamp-disk"
        )  # the personal states are checkpointed
