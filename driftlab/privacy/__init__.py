"""Client-level differential privacy for every algorithm of the seam: clipping, seeded noise, exact accounting.

* ``settings``: ``PrivacySettings``, what a run's ``[privacy]`` section resolves to;
* ``mechanism``: ``with_privacy(algorithm, settings)``, the wrapper that clips each
  client's released vector (``seam.ReleaseForm``) and noises the server's sum;
* ``accounting``: ε(δ) from Opacus's RDP and PRV accountants (the ``privacy`` extra).
"""


def __getattr__(name: str) -> object:
    """``PrivacyForm``: the old name of ``driftlab.simulation.seam.ReleaseForm``, imported when first read (the
    package itself imports nothing, so ``driftlab.privacy.settings`` stays light)."""
    if name == "PrivacyForm":
        from driftlab.simulation.seam import ReleaseForm

        return ReleaseForm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
