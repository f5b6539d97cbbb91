"""Partitions of a centralised training set over clients (benchmarks.md, "Partitions").

Every function takes the random generator explicitly and returns one int64
index array per client, sorted ascending (the order inside a client carries no
information: minibatch order is drawn by the trainer). Quotas (samples per
client) are computed separately, so any quota rule combines with any
partition rule:

    >>> rng = np.random.default_rng(0)
    >>> labels = np.repeat(np.arange(10), 100)
    >>> quotas = lognormal_quotas(len(labels), 20, sigma=0.3, rng=rng)
    >>> clients = dirichlet_client_prior_partition(labels, quotas, alpha=0.3, rng=rng)
    >>> [len(c) for c in clients] == quotas.tolist()
    True

Sources:
    - IID and lognormal quotas: Acar et al. 2021 (FedDyn), Section 5 and
      Appendix A.1, and the authors' ``utils_dataset.py``.
    - Dirichlet, client-prior form: FedDyn Appendix A.1 ("a vector of size
      equal to the number of classes is drawn using Dirichlet distribution for
      each device ... one label is sampled based on these vectors for each
      device and an image is sampled without replacement based on the label.
      This process is repeated until all datapoints are assigned"), also used
      by AdaBest (Varno et al. 2022).
    - Dirichlet, class-wise form: Hsu, Qi and Brown 2019 ("Measuring the
      effects of non-identical data distribution"), as in Flower's
      ``DirichletPartitioner`` and NIID-Bench (Li et al. 2022).
    - m classes per client: McMahan et al. 2017 (FedAvg's shards); EFL's
      "non-IID(m)" (Ma et al.), after Sattler et al.'s setup.
    - power law: Li et al. (FedProx), the authors' ``data/mnist/generate_niid.py``.
    - natural partitions: LEAF (Caldas et al. 2018): FEMNIST by writer,
      Shakespeare by speaking role, Sent140 by user.
    - per-client test splits: LEAF / FedProx (90/10 per user), the decaying-K
      paper (last 20% of each client), EFL's mean per-client test accuracy.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "balanced_quotas",
    "classes_per_client_partition",
    "dirichlet_classwise_partition",
    "dirichlet_client_prior_partition",
    "iid_partition",
    "lognormal_quotas",
    "natural_client_groups",
    "natural_partition",
    "power_law_partition",
    "split_client_test",
]


def balanced_quotas(num_samples: int, num_clients: int) -> np.ndarray:
    """Equal client sizes that sum exactly to ``num_samples``.

    Each client gets ``num_samples // num_clients``; the remainder
    ``num_samples % num_clients`` is spread one sample each over the first
    clients. Example: 10 samples over 4 clients gives ``[3, 3, 2, 2]``.

    Returns:
        int64 ``[num_clients]``, every entry at least 1.
    """
    _check_counts(num_samples, num_clients)
    quotas = np.full(num_clients, num_samples // num_clients, dtype=np.int64)
    quotas[: num_samples % num_clients] += 1
    return quotas


def lognormal_quotas(num_samples: int, num_clients: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Unbalanced client sizes from a lognormal, as in FedDyn (Acar et al. 2021, Appendix A.1).

    Procedure (the authors' ``utils_dataset.py``):
        1. draw ``s_k ~ LogNormal(mean=log(n/K), sigma)`` for each of the K clients;
        2. ``q_k = floor(s_k / sum(s) * n)``;
        3. add the rounding remainder ``n - sum(q)`` to client 0.
    ``sigma`` is the standard deviation of ``log s_k``; FedDyn's unbalanced
    setting uses 0.3, and ``sigma = 0`` gives balanced sizes (remainder on client 0).

    Beware with many clients: flooring loses about half a sample per client,
    and all of it goes to client 0. At FedDyn's 100 clients of 500 that is
    about +50 samples (+10%); at 1,000 clients of 50, client 0 gets about 500
    extra, ten times the mean. This is the authors' rule, kept for fidelity.

    Deviation from the authors' code, which can leave a client empty: a client
    rounded down to 0 is raised to 1, and the samples this adds are taken one
    at a time from the currently largest client. This only happens when some
    ``s_k`` is tiny relative to the others and leaves all other quotas as drawn.

    Returns:
        int64 ``[num_clients]`` summing exactly to ``num_samples``, every entry at least 1.
    """
    _check_counts(num_samples, num_clients)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0 (the std of log client size), got {sigma}")
    sizes = rng.lognormal(mean=math.log(num_samples / num_clients), sigma=sigma, size=num_clients)
    total = sizes.sum()
    if not (np.isfinite(total) and total > 0):
        raise ValueError(
            f"sigma={sigma} is too large: the lognormal draws overflow or underflow float64; use a smaller sigma"
        )
    quotas = np.floor(sizes / sizes.sum() * num_samples).astype(np.int64)
    quotas[0] += num_samples - quotas.sum()
    return _raise_empty_clients(quotas)


def iid_partition(num_samples: int, quotas: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """IID split: shuffle the sample indices, cut them into consecutive runs of ``quotas``.

    If ``sum(quotas) < num_samples`` the samples left after the last cut are
    not assigned to anyone (a uniformly random subsample is used).

    Returns:
        One sorted int64 index array per client, of length ``quotas[k]``.
    """
    quotas = _check_quotas(quotas, num_samples)
    order = rng.permutation(num_samples)
    cuts = np.cumsum(quotas)[:-1]
    return tuple(np.sort(part) for part in np.split(order[: quotas.sum()], cuts))


def dirichlet_client_prior_partition(
    labels: np.ndarray,
    quotas: np.ndarray,
    alpha: float,
    rng: np.random.Generator,
    num_classes: int | None = None,
) -> tuple[np.ndarray, ...]:
    """Label-skewed split, Dirichlet client-prior form (FedDyn Appendix A.1; AdaBest).

    The sequential procedure of the paper and the authors' code:
        1. every client k draws a class prior ``p_k ~ Dir(alpha * 1)``;
        2. repeat until every client holds its quota: pick a client uniformly
           among those with remaining quota; draw a class ``c ~ p_k``, redrawing
           while ``c`` has no unused sample left (i.e. exhausted classes are
           removed from the prior, which is renormalised); give the client an
           unused sample of class ``c``, chosen uniformly at random.

    This implementation produces exactly the same distribution over
    partitions, vectorised so that 50,000 samples over 1,000 clients at
    ``alpha = 0.03`` take well under a second. (Implementations that redraw
    rejected classes one at a time, as the authors' code does, can run
    practically forever there: at small alpha a client's prior may give the
    classes still available a total mass of 1e-20.) How:

    * The client sequence does not depend on the classes drawn, so it is drawn
      first and in bulk (:func:`_client_sequence`): blocks of uniform draws over
      the clients that still have quota, keeping each client's first
      ``remaining quota`` appearances. Dropping a full client's later
      appearances is the authors' "resample if full" rejection, so the kept
      sequence is distributed exactly as the sequential one.
    * Classes are drawn in phases (:func:`_class_sequence`). While the set of
      available classes does not change, the draws of different steps are
      independent, so all remaining steps draw at once from the priors
      restricted to the available classes. The first step whose class has run
      out is a draw the sequential procedure would have rejected; it and all
      later draws are discarded, exhausted classes are removed, and the
      remaining steps are redrawn. Each phase exhausts at least one class, so
      there are at most ``num_classes + 1`` phases.
    * Which sample of a class a step receives is uniform among unused ones:
      each class's indices are shuffled once and handed out in step order.

    Numerical edge case the paper leaves open: with tiny alpha, a prior can put
    all its mass (in floating point, exactly zero elsewhere) on classes that
    are already exhausted; such a client then draws uniformly among the
    available classes. (The authors' rejection loop would never end there.)

    Args:
        labels: 1-D non-negative integer class ids, one per training sample.
        quotas: samples per client (e.g. from :func:`balanced_quotas` or
            :func:`lognormal_quotas`), each at least 1, summing to at most
            ``len(labels)``; samples beyond the total stay unassigned.
        alpha: Dirichlet concentration, > 0. Small alpha (0.03) gives clients
            dominated by one or two classes; large alpha (100) gives each
            client nearly the global class mixture. FedDyn uses 0.3 and 0.6.
        rng: the random generator; the result is a deterministic function of its state.
        num_classes: number of classes for the priors; defaults to
            ``labels.max() + 1``. Classes without samples are never drawn.

    Returns:
        One sorted int64 index array per client, of length exactly ``quotas[k]``.
    """
    labels = _check_labels(labels, num_classes)
    num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
    quotas = _check_quotas(quotas, len(labels))
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0 (the Dirichlet concentration), got {alpha}")

    priors = rng.dirichlet(np.full(num_classes, alpha), size=len(quotas))
    clients = _client_sequence(quotas, rng)
    available = np.bincount(labels, minlength=num_classes)
    classes = _class_sequence(clients, priors, available, rng)

    # Hand out samples: each class's indices in a random order, taken in step order.
    sample_of_step = np.empty(len(clients), dtype=np.int64)
    for cls in np.unique(classes):
        steps = np.flatnonzero(classes == cls)
        pool = rng.permutation(np.flatnonzero(labels == cls))
        sample_of_step[steps] = pool[: len(steps)]
    by_client = np.argsort(clients, kind="stable")
    cuts = np.cumsum(quotas)[:-1]
    return tuple(np.sort(part) for part in np.split(sample_of_step[by_client], cuts))


def _client_sequence(quotas: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Step-by-step client ids: each step picks uniformly among clients with remaining quota.

    Client k appears exactly ``quotas[k]`` times. Drawn in blocks: a block of
    uniform draws over the clients not yet full, of which each client keeps
    its first ``remaining[k]`` appearances (later ones would be rejected by the
    sequential procedure anyway). Every block keeps at least its first draw.
    """
    remaining = quotas.astype(np.int64)
    blocks = []
    while remaining.sum() > 0:
        open_clients = np.flatnonzero(remaining > 0)
        draws = open_clients[rng.integers(len(open_clients), size=int(remaining.sum()))]
        keep = _occurrence_rank(draws) < remaining[draws]
        kept = draws[keep]
        remaining -= np.bincount(kept, minlength=len(remaining))
        blocks.append(kept)
    return np.concatenate(blocks)


def _class_sequence(
    clients: np.ndarray, priors: np.ndarray, available: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Class drawn at each step, from the step's client prior restricted to non-exhausted classes.

    Phases: draw all remaining steps at once with the current set of available
    classes; keep the steps before the first one that overdraws a class;
    remove exhausted classes; repeat from that step.
    """
    available = available.astype(np.int64)  # a copy: decremented as samples are taken
    classes = np.empty(len(clients), dtype=np.int64)
    start = 0
    while start < len(clients):
        open_mask = available > 0
        drawn = _draw_categorical(priors[clients[start:]] * open_mask, open_mask, rng)
        overdrawn = _occurrence_rank(drawn) >= available[drawn]
        stop = start + (int(np.argmax(overdrawn)) if overdrawn.any() else len(drawn))
        classes[start:stop] = drawn[: stop - start]
        available -= np.bincount(drawn[: stop - start], minlength=len(available))
        start = stop
    return classes


def _draw_categorical(weights: np.ndarray, fallback: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One class per row, with probability proportional to the row of ``weights``.

    Rows whose weights are all zero draw in proportion to ``fallback`` instead.
    Uses inverse-CDF sampling with one uniform per row.
    """
    totals = weights.sum(axis=1, keepdims=True)
    weights = np.where(totals > 0, weights, fallback.astype(weights.dtype))
    cumulative = np.cumsum(weights, axis=1)
    thresholds = rng.random(len(weights)) * cumulative[:, -1]
    # The first class whose cumulative weight exceeds the threshold; strict
    # ">" means a zero-weight class (a flat step in the CDF) is never chosen.
    drawn = (cumulative <= thresholds[:, None]).sum(axis=1)
    # Guard against rounding at the top of the CDF: fall back to the last positive class.
    last_positive = weights.shape[1] - 1 - np.argmax(weights[:, ::-1] > 0, axis=1)
    return np.minimum(drawn, last_positive)


def _occurrence_rank(values: np.ndarray) -> np.ndarray:
    """For each position, how many earlier positions hold the same value (0 for the first)."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    group_start = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    group_sizes = np.diff(np.r_[group_start, len(values)])
    rank_sorted = np.arange(len(values)) - np.repeat(group_start, group_sizes)
    rank = np.empty(len(values), dtype=np.int64)
    rank[order] = rank_sorted
    return rank


def _raise_empty_clients(quotas: np.ndarray) -> np.ndarray:
    """Give every empty client one sample, taken one at a time from the largest client."""
    quotas = quotas.copy()
    for client in np.flatnonzero(quotas == 0):
        quotas[np.argmax(quotas)] -= 1
        quotas[client] = 1
    return quotas


def _check_counts(num_samples: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    if num_samples < num_clients:
        raise ValueError(
            f"cannot give each of {num_clients} clients at least one sample from only {num_samples} "
            "samples; use fewer clients or more data"
        )


def _check_quotas(quotas: np.ndarray, num_samples: int) -> np.ndarray:
    quotas = np.asarray(quotas)
    if quotas.ndim != 1 or len(quotas) == 0 or not np.issubdtype(quotas.dtype, np.integer):
        raise ValueError(
            f"quotas must be a non-empty 1-D integer array (samples per client), got {quotas.dtype} "
            f"of shape {quotas.shape}; build it with balanced_quotas or lognormal_quotas"
        )
    if quotas.min() < 1:
        raise ValueError(
            f"every client needs a quota of at least 1 sample, but client {int(np.argmin(quotas))} "
            f"has {int(quotas.min())}"
        )
    if quotas.sum() > num_samples:
        raise ValueError(
            f"quotas sum to {int(quotas.sum())} but there are only {num_samples} samples; "
            "quotas may sum to at most the number of samples"
        )
    return quotas.astype(np.int64)


def _check_labels(labels: np.ndarray, num_classes: int | None) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) == 0 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"labels must be a non-empty 1-D integer array of class ids, got {labels.dtype} of shape "
            f"{labels.shape}; for a torch tensor pass tensor.numpy()"
        )
    if labels.min() < 0:
        raise ValueError(f"labels must be non-negative class ids, found {int(labels.min())}")
    if num_classes is not None and labels.max() >= num_classes:
        raise ValueError(
            f"labels contain class {int(labels.max())} but num_classes={num_classes}; "
            "pass a larger num_classes or leave it as None to infer it"
        )
    return labels.astype(np.int64, copy=False)
