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
from collections.abc import Sequence

import numpy as np

__all__ = [
    "balanced_quotas",
    "classes_per_client_partition",
    "deal_test_like_training",
    "dirichlet_classwise_partition",
    "dirichlet_client_prior_partition",
    "iid_partition",
    "kept_clients",
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


def dirichlet_classwise_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_client_size: int = 10,
    *,
    num_classes: int | None = None,
    max_attempts: int = 10,
    self_balancing: bool = False,
) -> tuple[np.ndarray, ...]:
    """Label-skewed split, Dirichlet class-wise form (Hsu et al. 2019; Flower's ``DirichletPartitioner``).

    Procedure (one attempt):
        for each class c (ascending), its samples in a random order are cut
        over the clients in proportions ``p_c ~ Dir(alpha * 1_K)``: client k
        receives ``floor(P_c,k * n_c) - floor(P_c,k-1 * n_c)`` of them, where
        ``P_c`` is the cumulative sum of ``p_c`` (the cut used by Flower and
        NIID-Bench: ``np.split(idx, (cumsum(p) * n_c).astype(int)[:-1])``), so
        every sample of every class is assigned.
    The attempt is repeated, with fresh draws from ``rng``, until every client
    holds at least ``min_client_size`` samples; after ``max_attempts`` failed
    attempts a ValueError says to lower ``min_client_size`` or raise ``alpha``.

    Unlike the client-prior form, client sizes are not set in advance: they
    come out of the draws (a client's expected size is ``n / K``, with large
    spread at small alpha). Small alpha gives clients few classes, but also
    many clients with almost nothing: at 1,000 clients and alpha = 0.03 about
    a quarter of the clients receive no sample at all in a typical draw, so
    any ``min_client_size >= 1`` fails there (quickly, with the error) — use
    the client-prior form with quotas for that regime, or ``min_client_size=0``
    (empty clients are then returned as empty arrays, which
    ``FederatedDataset`` rejects).

    Args:
        labels: 1-D non-negative integer class ids, one per training sample.
        num_clients: number of clients K, at least 1.
        alpha: Dirichlet concentration, > 0 (small: label-skewed; large: near IID).
        rng: the random generator; the result is a deterministic function of its state.
        min_client_size: every client must end with at least this many samples
            (Flower's ``min_partition_size``, default 10); 0 accepts empty clients.
        num_classes: defaults to ``labels.max() + 1``; classes without samples are skipped.
        max_attempts: how many attempts before giving up (each costs one pass over the data).
        self_balancing: Flower's and NIID-Bench's option: while splitting a
            class, clients that already hold at least ``n / K`` samples get no
            share of it (the proportions of the others are renormalised; if
            their draws are all exactly zero they share uniformly). Keeps client
            sizes closer to ``n / K``; off by default, as in Flower.

    Returns:
        One sorted int64 index array per client; together they cover every sample exactly once.
    """
    labels = _check_labels(labels, num_classes)
    num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
    _check_positive_int(num_clients, "num_clients")
    _check_alpha(alpha)
    _check_nonnegative_int(min_client_size, "min_client_size")
    _check_positive_int(max_attempts, "max_attempts")
    if num_clients * min_client_size > len(labels):
        raise ValueError(
            f"{num_clients} clients of at least min_client_size={min_client_size} need "
            f"{num_clients * min_client_size} samples but there are only {len(labels)}; lower min_client_size"
        )
    order = np.argsort(labels, kind="stable")
    class_sizes = np.bincount(labels, minlength=num_classes)
    pools = [pool for pool in np.split(order, np.cumsum(class_sizes)[:-1]) if len(pool)]
    cap = len(labels) / num_clients
    smallest = 0
    for _ in range(max_attempts):
        sizes = np.zeros(num_clients, dtype=np.int64)
        owners, samples = [], []
        for pool in pools:
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            if self_balancing:
                open_clients = sizes < cap
                proportions = proportions * open_clients
                if proportions.sum() <= 0:
                    proportions = open_clients.astype(np.float64)
                proportions /= proportions.sum()
            cuts = np.minimum((np.cumsum(proportions) * len(pool)).astype(np.int64)[:-1], len(pool))
            shares = np.diff(np.concatenate(([0], cuts, [len(pool)])))
            owners.append(np.repeat(np.arange(num_clients), shares))
            samples.append(rng.permutation(pool))
            sizes += shares
        smallest = int(sizes.min())
        if smallest >= min_client_size:
            return _group_by_client(np.concatenate(owners), np.concatenate(samples), num_clients)
    raise ValueError(
        f"class-wise Dirichlet split (alpha={alpha}, {num_clients} clients, {len(labels)} samples): no attempt "
        f"in {max_attempts} gave every client at least min_client_size={min_client_size} samples (the smallest "
        f"client of the last attempt had {smallest}); lower min_client_size or raise alpha (or use fewer clients, "
        "or the client-prior form, dirichlet_client_prior_partition, whose quotas fix the client sizes)"
    )


def classes_per_client_partition(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    quotas: np.ndarray | None = None,
    *,
    num_classes: int | None = None,
) -> tuple[np.ndarray, ...]:
    """m classes per client: label-sorted shards (FedAvg's pathological non-IID; EFL's "non-IID(m)").

    Exactly (K clients, m = ``classes_per_client``, S = K·m shards):
        1. if ``quotas`` sum to less than n, a uniformly random subset of that
           many samples is used (the rest stay unassigned);
        2. the classes are put in a random order, and the samples are sorted by
           class in that order (random order inside a class);
        3. the sorted sequence is cut into S consecutive shards. Without
           ``quotas`` the shard sizes are ``balanced_quotas(n, S)`` (they differ
           by at most one, larger ones first); with ``quotas`` client k's quota
           is split into m parts (``balanced_quotas(q_k, m)``) and those are
           its shard sizes, so each client's size is exactly ``q_k``;
        4. shards are dealt round-robin: the shard at position ``j·K + s``
           (``j < m``, ``s < K``) goes to the client in slot s, where slots are
           a random permutation of the clients. A client's m shards are
           therefore K positions apart in the class-sorted sequence.

    Aligned case (the classic setting: e.g. 10 balanced classes of 6,000
    samples, 100 clients, m = 2: 200 shards of 300, 20 per class): every shard
    lies inside one class and no class has more than K shards (it holds at
    most a fraction 1/m of the data). Then every client holds exactly m
    distinct classes — two shards K positions apart cannot be in one class.
    (FedAvg deals the shards at random instead, which gives some clients two
    shards of one class; this dealing never does, at the price of structure:
    clients in neighbouring slots get the same class combination.)

    Otherwise: a shard that straddles a class boundary gives its client an
    extra class (so clients hold up to about 2m classes, more if classes are
    smaller than a shard), and a class with more than K shards can give one
    client two shards of itself (fewer than m classes).

    Args:
        labels: 1-D non-negative integer class ids.
        num_clients: K, at least 1.
        classes_per_client: m, at least 1 and at most the number of classes with samples.
        rng: the random generator; the result is a deterministic function of its state.
        quotas: optional samples per client (``balanced_quotas``/``lognormal_quotas``),
            each at least m, summing to at most n; default: the n samples cut into
            S near-equal shards.
        num_classes: for validating labels; defaults to ``labels.max() + 1``.

    Returns:
        One sorted int64 index array per client (covering every sample when
        ``quotas`` is None or sums to n).
    """
    labels = _check_labels(labels, num_classes)
    _check_positive_int(num_clients, "num_clients")
    _check_positive_int(classes_per_client, "classes_per_client")
    present = int(np.count_nonzero(np.bincount(labels)))
    if classes_per_client > present:
        raise ValueError(
            f"classes_per_client={classes_per_client} but only {present} classes have samples; "
            "a client cannot hold more distinct classes than exist"
        )
    num_shards = num_clients * classes_per_client
    slots = rng.permutation(num_clients)  # slots[s]: the client dealt the shards at positions s, K + s, ...
    if quotas is None:
        if len(labels) < num_shards:
            raise ValueError(
                f"{num_clients} clients x {classes_per_client} classes need {num_shards} shards of at least one "
                f"sample, but there are only {len(labels)} samples; use fewer clients or classes per client"
            )
        shard_sizes = balanced_quotas(len(labels), num_shards)
        chosen = np.arange(len(labels))
    else:
        quotas = _check_quotas(quotas, len(labels))
        if len(quotas) != num_clients:
            raise ValueError(
                f"quotas has {len(quotas)} entries but num_clients={num_clients}; give one quota per client"
            )
        if quotas.min() < classes_per_client:
            raise ValueError(
                f"client {int(np.argmin(quotas))} has a quota of {int(quotas.min())}, fewer than "
                f"classes_per_client={classes_per_client} (each of its shards needs at least one sample)"
            )
        parts = np.stack([balanced_quotas(int(q), classes_per_client) for q in quotas])  # [K, m]
        shard_sizes = parts[slots].T.reshape(-1)  # position j*K + s -> part j of the client in slot s
        total = int(quotas.sum())
        chosen = (
            np.sort(rng.choice(len(labels), size=total, replace=False))
            if total < len(labels)
            else np.arange(len(labels))
        )
    class_rank = rng.permutation(int(labels.max()) + 1)
    shuffled = rng.permutation(chosen)
    ordered = shuffled[np.argsort(class_rank[labels[shuffled]], kind="stable")]
    owner_of_shard = np.tile(slots, classes_per_client)
    return _group_by_client(np.repeat(owner_of_shard, shard_sizes), ordered, num_clients)


def power_law_partition(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    *,
    min_per_class: int = 5,
    sigma: float = 2.0,
    num_classes: int | None = None,
) -> tuple[np.ndarray, ...]:
    """Few labels per client with heavy-tailed sizes: FedProx's MNIST (1,000 devices, 2 digits each).

    Follows the FedProx authors' generator (``data/mnist/generate_niid.py``):
        1. client k holds the classes ``(k + j) mod C`` for ``j < m``
           (m = ``classes_per_client``, C = ``num_classes``): consecutive
           clients hold overlapping class pairs (0-1, 1-2, ..., 9-0, 0-1, ...);
        2. every (client, class) slot first receives ``min_per_class`` samples
           of its class (the authors: 5);
        3. each slot draws a weight ``w ~ LogNormal(0, sigma)`` (the authors:
           sigma = 2); the samples of class c left after step 2 are shared over
           the slots of class c in proportion to their weights, rounded down:
           ``floor(w / sum_c(w) * remaining_c)``.
    The paper calls the resulting sizes a power law; the authors' code draws
    them lognormal with sigma 2, which is heavy-tailed (the largest client is
    typically tens of times the median). As in their code, the rounding
    remainder stays unassigned: fewer samples of class c than c has slots
    (so at most ``K * m`` samples in all). Which samples a slot receives is
    uniformly random within its class (the authors take them in file order).

    For FedProx's exact setting use the 70,000 MNIST images (train and test
    together), 1,000 clients, m = 2, and then ``split_client_test(..., 0.1, rng)``
    (their per-device 90/10 split).

    Args:
        labels: 1-D non-negative integer class ids.
        num_clients: K, at least 1.
        classes_per_client: m, between 1 and C.
        rng: the random generator; the result is a deterministic function of its state.
        min_per_class: samples each (client, class) slot gets first, at least 1.
        sigma: standard deviation of the log weights, >= 0 (0: equal shares).
        num_classes: C; defaults to ``labels.max() + 1``.

    Returns:
        One sorted int64 index array per client, each holding samples of its m classes only.
    """
    labels = _check_labels(labels, num_classes)
    num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
    _check_positive_int(num_clients, "num_clients")
    _check_positive_int(classes_per_client, "classes_per_client")
    _check_positive_int(min_per_class, "min_per_class")
    if classes_per_client > num_classes:
        raise ValueError(f"classes_per_client={classes_per_client} exceeds the {num_classes} classes")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0 (the std of the log slot weights), got {sigma}")
    slot_client = np.repeat(np.arange(num_clients), classes_per_client)
    slot_class = (slot_client + np.tile(np.arange(classes_per_client), num_clients)) % num_classes
    slots_per_class = np.bincount(slot_class, minlength=num_classes)
    class_sizes = np.bincount(labels, minlength=num_classes)
    short = np.flatnonzero(class_sizes < slots_per_class * min_per_class)
    if len(short):
        c = int(short[0])
        raise ValueError(
            f"class {c} has {int(class_sizes[c])} samples but its {int(slots_per_class[c])} (client, class) slots need "
            f"min_per_class={min_per_class} each ({int(slots_per_class[c] * min_per_class)}); "
            "lower min_per_class or use fewer clients"
        )
    weights = rng.lognormal(mean=0.0, sigma=sigma, size=len(slot_class))
    slot_sizes = np.full(len(slot_class), min_per_class, dtype=np.int64)
    owners, samples = [], []
    for c in np.flatnonzero(slots_per_class):
        slots = np.flatnonzero(slot_class == c)
        remaining = int(class_sizes[c] - len(slots) * min_per_class)
        slot_sizes[slots] += np.floor(weights[slots] / weights[slots].sum() * remaining).astype(np.int64)
        pool = rng.permutation(np.flatnonzero(labels == c))
        owners.append(np.repeat(slot_client[slots], slot_sizes[slots]))
        samples.append(pool[: int(slot_sizes[slots].sum())])
    return _group_by_client(np.concatenate(owners), np.concatenate(samples), num_clients)


def kept_clients(count: int, max_clients: int | None, rng: np.random.Generator | None = None) -> np.ndarray:
    """The positions, in increasing order, of the clients ``data.max_clients`` keeps out of ``count``.

    ``rng`` None keeps the first ``max_clients``; a generator draws ``max_clients`` of them uniformly without
    replacement (``rng.choice``).  Every client is kept when ``max_clients`` is None or at least ``count``.
    """
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be at least 1 or None, got {max_clients}")
    if max_clients is None or max_clients >= count:
        return np.arange(count, dtype=np.int64)
    if rng is None:
        return np.arange(max_clients, dtype=np.int64)
    return np.sort(rng.choice(count, size=max_clients, replace=False)).astype(np.int64)


def natural_partition(group_ids: np.ndarray, order: str = "first") -> tuple[np.ndarray, ...]:
    """One client per distinct group id: FEMNIST's writer, Shakespeare's speaking role, Sent140's user.

    Args:
        group_ids: 1-D array, one group id per sample (integers or strings;
            anything ``np.unique`` can sort).
        order: ``"first"``: clients in the order their group first appears in
            ``group_ids`` (LEAF's JSON user order, when the samples are read
            user by user); ``"sorted"``: clients in ascending group-id order.
            :func:`natural_client_groups` gives the group id of each client.

    Returns:
        One sorted int64 index array per group; together they cover every sample exactly once.
    """
    ids, inverse, first_seen = _check_groups(group_ids, order)
    client_of_group = _client_of_group(first_seen, order)
    return _group_by_client(client_of_group[inverse], np.arange(len(ids), dtype=np.int64), len(first_seen))


def natural_client_groups(group_ids: np.ndarray, order: str = "first") -> np.ndarray:
    """The group id of each client of ``natural_partition(group_ids, order)``, in client order."""
    ids, inverse, first_seen = _check_groups(group_ids, order)
    client_of_group = _client_of_group(first_seen, order)
    groups = np.empty(len(first_seen), dtype=ids.dtype)
    groups[client_of_group] = ids[first_seen]
    return groups


def split_client_test(
    client_indices, fraction: float, rng: np.random.Generator | None, *, shuffle: bool = True
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Each client's own local test split (EFL's mean per-client test accuracy; LEAF; FedProx).

    Client k with n_k samples keeps ``n_k - t_k`` for training and holds out
    ``t_k = min(ceil(fraction * n_k), n_k - 1)`` for testing: the training
    size is ``floor((1 - fraction) * n_k)``, as FedProx's and LEAF's
    ``int(0.9 * n)``, but never zero (a client of one sample has no test split).

    Args:
        client_indices: one 1-D integer index array per client, each non-empty
            (e.g. the output of any partition here).
        fraction: held-out fraction, in ``[0, 1)``; 0.1 for FedProx/LEAF, 0.2 for the decaying-K paper.
        rng: the random generator (unused, may be None, when ``shuffle`` is False).
        shuffle: True: a uniformly random subset is held out. False: the
            client's last samples in index order are held out (the decaying-K
            paper's "last 20% of each client's lines" for Shakespeare, where
            overlapping character windows would leak between random splits).

    Returns:
        ``(train, test)``: two tuples of sorted int64 arrays, one per client;
        ``train[k]`` and ``test[k]`` partition ``client_indices[k]``.
    """
    if not (isinstance(fraction, (int, float, np.floating)) and 0 <= fraction < 1):
        raise ValueError(f"fraction must be a number in [0, 1) (the held-out share of each client), got {fraction!r}")
    if shuffle and rng is None:
        raise ValueError("split_client_test with shuffle=True needs an rng (pass np.random.default_rng(seed))")
    clients = _check_client_indices(client_indices)
    train, test = [], []
    for indices in clients:
        n = len(indices)
        num_test = min(math.ceil(fraction * n - 1e-9), n - 1)
        ordered = rng.permutation(indices) if shuffle else np.sort(indices)
        train.append(np.sort(ordered[: n - num_test]))
        test.append(np.sort(ordered[n - num_test :]))
    return tuple(train), tuple(test)


def deal_test_like_training(
    client_train_labels: Sequence[np.ndarray], test_labels: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, ...]:
    """Deal test rows to clients so that each client's test labels follow its training labels.

    When clients that came with their own test rows are dealt out again (FEMNIST or Shakespeare made IID), their
    test rows are dealt too, instead of holding out a second share of the new clients' training rows.  The ``t_c``
    test rows of class ``c`` go to the clients in proportion to their training rows of ``c``: client k holding
    ``n_kc`` of the ``n_c`` gets ``⌊t_c n_kc / n_c⌋``, and the rows left go one each to the largest remainders
    ``t_c n_kc mod n_c`` (ties to the lower client); which rows a client gets is a random permutation of the class's
    rows.  Test rows of a class no client trains on go to no client.

    Args:
        client_train_labels: each client's training labels (integers).
        test_labels: the label of every test row.
        rng: draws the permutation of each class's test rows, class by class in increasing label order.

    Returns:
        One sorted int64 array of test-row positions per client (possibly empty).
    """
    test_labels = np.asarray(test_labels)
    num_clients = len(client_train_labels)
    classes = np.unique(test_labels)
    counts = np.stack(
        [
            np.bincount(np.searchsorted(classes, labels[np.isin(labels, classes)]), minlength=len(classes))
            for labels in map(np.asarray, client_train_labels)
        ]
    ).astype(np.int64)  # [clients, classes]: training rows of each class of the test rows
    owners = np.full(len(test_labels), -1, dtype=np.int64)
    for column, label in enumerate(classes):
        rows = np.flatnonzero(test_labels == label)
        total = counts[:, column].sum()
        if total == 0:
            continue
        share, remainder = np.divmod(len(rows) * counts[:, column], total)
        share[np.argsort(-remainder, kind="stable")[: len(rows) - share.sum()]] += 1
        owners[rng.permutation(rows)] = np.repeat(np.arange(num_clients), share)
    dealt = np.flatnonzero(owners >= 0)
    return _group_by_client(owners[dealt], dealt, num_clients)


def _group_by_client(owners: np.ndarray, samples: np.ndarray, num_clients: int) -> tuple[np.ndarray, ...]:
    """Sorted int64 sample arrays per client from parallel ``owners``/``samples`` arrays."""
    order = np.lexsort((samples, owners))
    cuts = np.cumsum(np.bincount(owners, minlength=num_clients))[:-1]
    return tuple(part.astype(np.int64, copy=False) for part in np.split(samples[order], cuts))


def _check_groups(group_ids, order: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if order not in ("first", "sorted"):
        raise ValueError(f"order must be 'first' (first appearance) or 'sorted' (ascending group id), got {order!r}")
    ids = np.asarray(group_ids)
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError(f"group_ids must be a non-empty 1-D array (one group id per sample), got shape {ids.shape}")
    try:
        _, first_seen, inverse = np.unique(ids, return_index=True, return_inverse=True)
    except TypeError as error:
        raise ValueError(
            f"group ids must be mutually comparable (all integers or all strings), got {ids.dtype}: {error}"
        ) from None
    return ids, inverse.reshape(-1), first_seen


def _client_of_group(first_seen: np.ndarray, order: str) -> np.ndarray:
    """Client number of each group (groups in sorted order)."""
    if order == "sorted":
        return np.arange(len(first_seen))
    client_of_group = np.empty(len(first_seen), dtype=np.int64)
    client_of_group[np.argsort(first_seen, kind="stable")] = np.arange(len(first_seen))
    return client_of_group


def _check_client_indices(client_indices) -> list[np.ndarray]:
    if isinstance(client_indices, np.ndarray) and client_indices.dtype != object:
        raise ValueError("client_indices must be a sequence of index arrays, one per client, not one array")
    clients = [np.asarray(indices) for indices in client_indices]
    if not clients:
        raise ValueError("client_indices is empty: need at least one client")
    for k, indices in enumerate(clients):
        if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(
                f"client_indices[{k}] must be a 1-D integer array, got {indices.dtype} of shape {indices.shape}"
            )
        if len(indices) == 0:
            raise ValueError(f"client {k} has no samples; every client needs at least one to split")
    return [indices.astype(np.int64, copy=False) for indices in clients]


def _check_positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_nonnegative_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, (int, float, np.floating)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0 (the Dirichlet concentration), got {alpha}")


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


def _integer_vector(values, name: str, meaning: str, hint: str) -> np.ndarray:
    """``values`` as a non-empty 1-D integer array; else a ValueError saying what it holds and how to fix it."""
    array = np.asarray(values)
    if array.ndim != 1 or len(array) == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{name} must be a non-empty 1-D integer array {meaning}, got {array.dtype} of shape {array.shape}; {hint}"
        )
    return array


def _check_quotas(quotas: np.ndarray, num_samples: int) -> np.ndarray:
    quotas = _integer_vector(
        quotas, "quotas", "(samples per client)", "build it with balanced_quotas or lognormal_quotas"
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
    labels = _integer_vector(labels, "labels", "of class ids", "for a torch tensor pass tensor.numpy()")
    if labels.min() < 0:
        raise ValueError(f"labels must be non-negative class ids, found {int(labels.min())}")
    if num_classes is not None and labels.max() >= num_classes:
        raise ValueError(
            f"labels contain class {int(labels.max())} but num_classes={num_classes}; "
            "pass a larger num_classes or leave it as None to infer it"
        )
    return labels.astype(np.int64, copy=False)
