"""Model zoo (plain torch.nn modules)."""

from driftlab.models.zoo import MLP, MODEL_NAMES, MultinomialLogisticRegression, build_model

__all__ = ["MLP", "MODEL_NAMES", "MultinomialLogisticRegression", "build_model"]
