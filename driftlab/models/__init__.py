"""Model zoo (plain torch.nn modules)."""

from driftlab.models.zoo import (
    MLP,
    MODEL_NAMES,
    CharGRU,
    CharLSTM,
    FedDynCNN,
    FemnistCNN,
    MultinomialLogisticRegression,
    build_model,
    resnet18_groupnorm,
    vgg11,
)

__all__ = [
    "MLP",
    "MODEL_NAMES",
    "CharGRU",
    "CharLSTM",
    "FedDynCNN",
    "FemnistCNN",
    "MultinomialLogisticRegression",
    "build_model",
    "resnet18_groupnorm",
    "vgg11",
]
