"""Client-level differential privacy for every algorithm of the seam: clipping, seeded noise, exact accounting.

* ``settings``: ``PrivacySettings``, what a run's ``[privacy]`` section resolves to;
* ``mechanism``: ``with_privacy(algorithm, settings)``, the wrapper that clips each
  client's released vector (``seam.PrivacyForm``) and noises the server's sum;
* ``accounting``: ε(δ) from Opacus's RDP and PRV accountants (the ``privacy`` extra).
"""
