"""Model-replacement backdoor (Bagdasaryan, Veit, Hua, Estrin and Shmatikov, "How To Backdoor Federated Learning",
AISTATS 2020) and its attack-success metric.

The attacker trains a backdoored model X on data in which some rows carry a
trigger and the attacker's target label, then reports a model scaled so that
it replaces the global model G after averaging.  With n clients averaged per
round and server learning rate η, G⁺ = G + (η/n) Σ_i (L_i − G); reporting

    L̃ = γ (X − G) + G,   γ = n / η

gives G⁺ ≈ X when the honest changes roughly cancel (their Equation 3).
In update form the reported change is γ (X − G).

The trigger here is a pixel pattern: a ``size``×``size`` square of ``value``
in the bottom-right corner of each image (the last two dimensions), a simple
stand-in for the paper's semantic backdoors (cars with stripes, green cars)
that works on any image data set.  The attack success rate is the share of
test examples whose true label is not the target that the model, fed the
triggered input, classifies as the target.  Only the model change is scaled:
a SCAFFOLD attacker's Δc_k and an EFL attacker's Fisher terms are those of its
poisoned training, sent unscaled (docs/update-rules.md states the choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Trigger:
    size: int = 3
    value: float = 1.0
    target_label: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"backdoor trigger size must be a positive number of pixels, got {self.size!r}")
        if not isinstance(self.target_label, int) or self.target_label < 0:
            raise ValueError(f"backdoor target_label must be a class index, got {self.target_label!r}")


def replacement_scale(num_clients: int, server_lr: float) -> float:
    """γ = n / η."""
    if num_clients < 1 or not server_lr > 0:
        raise ValueError(
            "model replacement needs n ≥ 1 clients and a positive server learning rate, "
            f"got n = {num_clients}, η = {server_lr}"
        )
    return num_clients / server_lr


def model_replacement(
    backdoored: torch.Tensor, global_params: torch.Tensor, num_clients: int, server_lr: float
) -> torch.Tensor:
    """The reported model L̃ = γ (X − G) + G."""
    return replacement_scale(num_clients, server_lr) * (backdoored - global_params) + global_params


def add_trigger(images: torch.Tensor, trigger: Trigger) -> torch.Tensor:
    """A copy of ``images`` ([..., H, W]) with the trigger square in the bottom-right corner of each."""
    if images.dim() < 2 or images.shape[-1] < trigger.size or images.shape[-2] < trigger.size:
        raise ValueError(
            f"the backdoor trigger of {trigger.size}×{trigger.size} pixels needs images of at least that size, "
            f"got shape {tuple(images.shape)}"
        )
    triggered = images.clone()
    triggered[..., -trigger.size :, -trigger.size :] = trigger.value
    return triggered


def poison_batch(
    images: torch.Tensor, targets: torch.Tensor, trigger: Trigger, fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch with ⌊fraction · B⌋ rows, drawn from ``generator`` (``byzantine.poison_generator``), triggered and
    relabelled to the target (the paper mixes a fixed number of backdoor rows into each batch)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"backdoor poison fraction must be in [0, 1], got {fraction}")
    count = int(fraction * images.shape[0] + 1e-9)
    rows = torch.randperm(images.shape[0], generator=generator)[:count].to(images.device)
    images, targets = images.clone(), targets.clone()
    images[rows] = add_trigger(images[rows], trigger)
    targets[rows] = trigger.target_label
    return images, targets


def attack_success_rate(predictions: torch.Tensor, true_labels: torch.Tensor, target_label: int) -> float:
    """Of the examples whose true label is not the target, the share predicted as the target (on triggered inputs)."""
    eligible = true_labels != target_label
    if not bool(eligible.any()):
        raise ValueError("attack success needs test examples whose true label differs from the backdoor's target label")
    return float((predictions[eligible] == target_label).double().mean())
