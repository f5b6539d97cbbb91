"""Partial-model personalization (FedPer, LG-FedAvg, FedRep): ``[personal_layers]`` keeps some of the model's
parameters on each client (``wrapping.with_personal_layers``; the section ``section.py``, the entry ``feature.py``)."""
