"""Seeded attack simulation (issue 44): who attacks, and what they send; in runs ``[attack]`` (``attacks.feature``).

* ``byzantine``: ``Byzantine`` (a ``fraction`` drawn from the run seed, or fixed ``clients``, from
  ``start_round``), ``byzantine_clients``, ``attackers_in_round`` and the seeded generators of the attacks' draws;
* ``model_updates``: ``forge(settings, honest_update, honest_updates=…)`` for sign flipping, scaled updates,
  Gaussian noise, ALIE, IPM, min-max and min-sum; ``ATTACKS`` maps names to settings;
* ``label_flipping``: ``flip_labels`` (data poisoning, y → C − 1 − y);
* ``backdoor``: model replacement (γ = n/η), the trigger, batch poisoning and ``attack_success_rate``.

What each attack forges when a message carries more than a model change.  Our
choice: a model-update attack acts on the message's whole released vector, the
one ``seam.ReleaseForm`` names (FedAvg, FedProx, FedDyn, AdaBest: θ_k − θ;
SCAFFOLD: cat(Δy_k, Δc_k); EFL: cat(θ_k − θ, Δu_k, Δv_k)), and the
omniscient attacks take their statistics over the honest clients' vectors of
the same kind.  Coordinate-wise attacks (sign, scale, noise, ALIE, IPM) act on
each part as they would alone; min-max and min-sum measure distance over the
whole vector, so one γ serves every part.

| attack | FedAvg, FedProx: Δ | SCAFFOLD: Δy_k, Δc_k | FedDyn, AdaBest: Δ | EFL: Δθ, Δu_k, Δv_k |
|---|---|---|---|---|
| sign flip, scaled | −sΔ, sΔ | both halves (a) | Δ (b) | all three (c) |
| Gaussian noise | ξ, or Δ + ξ | both halves (a) | Δ (b) | all three (c) |
| ALIE, IPM | μ − zσ, −εμ | per coordinate, both halves (a) | Δ (b) | per coordinate, all three (c) |
| min-max, min-sum | μ + γp | one γ for cat(Δy, Δc) (a) | Δ (b) | one γ for the concatenation (c) |
| label flipping | honest, flipped data | both honest, flipped data | honest, flipped data | Fisher of flipped data |
| backdoor | γ(X − G) | Δy scaled, Δc unscaled | Δ scaled (b) | Δθ scaled; u, v unscaled |

(a) the server's c ← c + Σ_P Δc_k / N takes the forged Δc, so every client's
correction c − c_k carries it in later rounds; (b) the server's h sums the
forged Δ (FedDyn's h ← h − α Σ_P Δ / N, AdaBest's from θ̄), so the harm
outlives the round; (c) a forged Δu can make U = Σ u_i negative, and the
elastic term λU ⊙ (θ − V/U) concave.

A Byzantine client's own state (c_k, λ_k, h_k) stays with it: forging it
changes nothing the server sees beyond the message.  Equations, papers and
choices: docs/update-rules.md, "Robust aggregation and attacks (issue 44)".
The wrap (``wrapper.with_attack``) forges at the server, before ``[robust]``
aggregates; label flipping and the backdoor await a per-client data seam.
"""

from driftlab.attacks.backdoor import Trigger, add_trigger, attack_success_rate, model_replacement, poison_batch
from driftlab.attacks.byzantine import (
    Byzantine,
    attackers_in_round,
    byzantine_clients,
    noise_generator,
    poison_generator,
)
from driftlab.attacks.label_flipping import flip_labels
from driftlab.attacks.model_updates import (
    ATTACKS,
    GaussianNoise,
    InnerProduct,
    LittleIsEnough,
    MinMax,
    MinSum,
    Scaled,
    SignFlip,
    alie_z_max,
    forge,
    min_max_gamma,
)

__all__ = [
    "ATTACKS",
    "Byzantine",
    "GaussianNoise",
    "InnerProduct",
    "LittleIsEnough",
    "MinMax",
    "MinSum",
    "Scaled",
    "SignFlip",
    "Trigger",
    "add_trigger",
    "alie_z_max",
    "attack_success_rate",
    "attackers_in_round",
    "byzantine_clients",
    "flip_labels",
    "forge",
    "min_max_gamma",
    "model_replacement",
    "noise_generator",
    "poison_batch",
    "poison_generator",
]
