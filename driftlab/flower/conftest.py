"""Flower reads its telemetry, update-check and dependency-installation switches once, at the first ``import flwr``:
set them here, before any test module of this package imports flwr, so no test phones home or installs anything."""

import os

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
