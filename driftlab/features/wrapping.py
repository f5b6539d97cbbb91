"""What a feature's algorithm wrapper (``FeatureEntry.wrap``: compression, privacy) shares: its server state and
client view hold the wrapped algorithm's as ``inner`` and show the wrapped model θ as their own ``params``, the one
field the seam reads of every state and view.

This module imports nothing from driftlab, so any wrapper can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Wrapping:
    """A wrapper's state or view: the wrapped algorithm's (``inner``), whose θ is this one's ``params``."""

    inner: Any

    @property
    def params(self) -> torch.Tensor:
        return self.inner.params
