"""Byzantine-robust aggregation of a round's reported model changes (issue 44).

Each rule replaces the mean of the round's ``[n, d]`` updates: a frozen settings
record per rule, one registry (``AGGREGATORS``: name -> settings constructor)
and one entry point, ``aggregate(settings or name, updates, weights)``, which
returns a ``RobustResult``: the aggregate and, per client, the share of it that
entered the aggregate (``kept``) and the factor put on it (``scale``).

| name | rule | paper | needs | weights |
|---|---|---|---|---|
| ``median`` | coordinate-wise median | Yin et al., ICML 2018 | n ≥ 1 | ignored |
| ``trimmed_mean`` | coordinate-wise β-trimmed mean | Yin et al., ICML 2018 | 0 ≤ β < ½ | ignored |
| ``krum`` | the update of lowest Krum score | Blanchard et al., NeurIPS 2017 | n > 2f + 2 | ignored |
| ``multi_krum`` | mean of the m lowest-score updates | Blanchard et al., NeurIPS 2017 | n > 2f + 2 | among the m |
| ``bulyan`` | recursive Krum, then a trimmed mean about the median | El Mhamdi et al., ICML 2018 | n ≥ 4f+3 | ignored |
| ``geometric_median`` | smoothed Weiszfeld (RFA) | Pillutla et al., IEEE TSP 2022 | ν > 0 | yes |
| ``centered_clipping`` | clipping around the last aggregate, momentum | Karimireddy et al., ICML 2021 | τ > 0 | yes |
| ``norm_bound`` | clip each update to norm M, then the mean | Sun et al. 2019 | M > 0 | yes |

Every rule can run on bucket means instead (``bucketed_aggregate``, Karimireddy, He and Jaggi, ICLR 2022: the
round's updates shuffled into buckets of s, each averaged; ``driftlab.robust.bucketing``).

Every rule is deterministic: ties go to the earlier client.  Equations, the
papers' ambiguities and our choices: docs/update-rules.md, "Robust aggregation
and attacks (issue 44)".  In runs: ``[robust]`` (``driftlab.robust.feature``,
``with_robust_aggregation`` in ``driftlab.robust.wrapper``).
"""

from driftlab.robust.bucketing import bucket_means, bucket_permutation, bucketed_aggregate
from driftlab.robust.clipping import CenteredClipping, CenteredClippingState, NormBound
from driftlab.robust.coordinatewise import Median, TrimmedMean
from driftlab.robust.geometric_median import GeometricMedian
from driftlab.robust.krum import Bulyan, Krum, MultiKrum
from driftlab.robust.registry import AGGREGATORS, Settings, aggregate, make_settings
from driftlab.robust.result import RobustResult

__all__ = [
    "AGGREGATORS",
    "Bulyan",
    "CenteredClipping",
    "CenteredClippingState",
    "GeometricMedian",
    "Krum",
    "Median",
    "MultiKrum",
    "NormBound",
    "RobustResult",
    "Settings",
    "TrimmedMean",
    "aggregate",
    "bucket_means",
    "bucket_permutation",
    "bucketed_aggregate",
    "make_settings",
]
