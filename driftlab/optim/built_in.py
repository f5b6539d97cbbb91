"""driftlab's own server optimizers and chain stages as registry entries: one config type per optimizer, holding
exactly the ``[server]`` keys it reads, and a ``build`` that calls ``driftlab.optim.server``.

The keys and defaults are those of the flat ``[server]`` section they replace, so every config validates, runs and
fingerprints as before: ``server.momentum`` is FedAvgM's β, ``beta2`` and ``epsilon`` default to none (the
optimizer's own default: adam 0.999 and 1e-8, adagrad and yogi 1e-3, yogi's β2 0.99), and FedAdagrad takes only
``epsilon`` (its β1 is 0; Reddi et al. 2020, Algorithm 2).

``optimizer = "chain"`` states the transformations in TOML (``server.transforms``), each a stage registered in
``registry.TRANSFORMATIONS``: ``chain`` of ``scale_by_adam`` and ``scale_by_learning_rate`` with
``bias_correction = true`` computes the floating-point operations of ``optimizer = "adam"`` (the same stages,
``driftlab.optim.server.adam``), so the two runs agree bit for bit and checkpoint under the same keys.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from driftlab.optim import server
from driftlab.optim.registry import (
    TRANSFORMATIONS,
    ServerOptimizerConfig,
    ServerOptimizerEntry,
    TransformationConfig,
    TransformationEntry,
    Transformations,
)

# ---------------------------------------------------------------- the named optimizers


class SgdConfig(ServerOptimizerConfig):
    optimizer: Literal["sgd"] = Field("sgd", description="FedSGD: θ ← θ − η q (FedAvg at lr 1)")


class MomentumConfig(ServerOptimizerConfig):
    optimizer: Literal["momentum"] = Field("momentum", description="server momentum (FedAvgM, Hsu et al. 2019)")
    momentum: float = Field(0.9, ge=0, lt=1, description="momentum β")


class AdamConfig(ServerOptimizerConfig):
    optimizer: Literal["adam"] = Field("adam", description="FedAdam (decaying-K paper, Algorithm 3)")
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay β1")
    beta2: float | None = Field(None, ge=0, lt=1, description="second-moment decay β2; none = 0.999")
    epsilon: float | None = Field(None, gt=0, description="ε added to √v; none = 1e-8")
    bias_correction: bool = Field(
        True, description="Adam bias correction (the decaying-K paper's Algorithm 3 has it; Reddi's has not)"
    )


class AdagradConfig(ServerOptimizerConfig):
    optimizer: Literal["adagrad"] = Field("adagrad", description="FedAdagrad (Reddi et al. 2020, Algorithm 2; β1 = 0)")
    epsilon: float | None = Field(None, gt=0, description="τ added to √v; none = 1e-3")


class YogiConfig(ServerOptimizerConfig):
    optimizer: Literal["yogi"] = Field("yogi", description="FedYogi (Reddi et al. 2020, Algorithm 2)")
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay β1")
    beta2: float | None = Field(None, ge=0, lt=1, description="second-moment rate β2; none = 0.99")
    epsilon: float | None = Field(None, gt=0, description="τ added to √v; none = 1e-3")


def _given(**values: object) -> dict[str, object]:
    """The keyword arguments that are set (a none key leaves the optimizer's own default)."""
    return {key: value for key, value in values.items() if value is not None}


def build_sgd(_section: SgdConfig) -> server.ServerOptimizer:
    return server.sgd()


def build_momentum(section: MomentumConfig) -> server.ServerOptimizer:
    return server.momentum(beta=section.momentum)


def build_adam(section: AdamConfig) -> server.ServerOptimizer:
    return server.adam(
        **_given(
            beta1=section.beta1, beta2=section.beta2, epsilon=section.epsilon, bias_correction=section.bias_correction
        )
    )


def build_adagrad(section: AdagradConfig) -> server.ServerOptimizer:
    return server.adagrad(**_given(epsilon=section.epsilon))


def build_yogi(section: YogiConfig) -> server.ServerOptimizer:
    return server.yogi(**_given(beta1=section.beta1, beta2=section.beta2, epsilon=section.epsilon))


# ---------------------------------------------------------------- the stages of a chain


class ClipByGlobalNormConfig(TransformationConfig):
    name: Literal["clip_by_global_norm"] = "clip_by_global_norm"
    max_norm: float = Field(gt=0, description="c: the update is scaled down to norm c when it is longer")


class ScaleByMomentumConfig(TransformationConfig):
    name: Literal["scale_by_momentum"] = "scale_by_momentum"
    beta: float = Field(0.9, ge=0, lt=1, description="momentum β: v ← β v + u")
    nesterov: bool = Field(
        False, description="u ← u + β v instead of u ← v (the form of torch.optim.SGD(nesterov=True))"
    )


class ScaleByAdamConfig(TransformationConfig):
    name: Literal["scale_by_adam"] = "scale_by_adam"
    beta1: float = Field(0.9, ge=0, lt=1, description="m ← β1 m + (1 − β1) u")
    beta2: float = Field(0.999, ge=0, lt=1, description="v ← β2 v + (1 − β2) u²")
    epsilon: float = Field(1e-8, gt=0, description="u ← m / (√v + ε)")


class ScaleByAdagradConfig(TransformationConfig):
    name: Literal["scale_by_adagrad"] = "scale_by_adagrad"
    beta1: float = Field(0.0, ge=0, lt=1, description="m ← β1 m + (1 − β1) u (0: m = u)")
    epsilon: float = Field(1e-3, gt=0, description="u ← m / (√v + τ), v ← v + u²")
    initial_accumulator: float = Field(0.0, ge=0, description="v before the first update")


class ScaleByYogiConfig(TransformationConfig):
    name: Literal["scale_by_yogi"] = "scale_by_yogi"
    beta1: float = Field(0.9, ge=0, lt=1, description="m ← β1 m + (1 − β1) u")
    beta2: float = Field(0.99, ge=0, lt=1, description="v ← v − (1 − β2) u² sign(v − u²)")
    epsilon: float = Field(1e-3, gt=0, description="u ← m / (√v + τ)")
    initial_accumulator: float = Field(1e-6, ge=0, description="v before the first update (Reddi et al.: at least τ²)")


class ScaleByLearningRateConfig(TransformationConfig):
    name: Literal["scale_by_learning_rate"] = "scale_by_learning_rate"
    bias_correction: bool = Field(False, description="η_t = η √(1 − β2^t) / (1 − β1^t), Adam's correction")
    beta1: float = Field(0.9, ge=0, lt=1, description="β1 of the bias correction")
    beta2: float = Field(0.999, ge=0, lt=1, description="β2 of the bias correction")

    @model_validator(mode="after")
    def _betas_only_with_the_correction(self) -> "ScaleByLearningRateConfig":
        # Not model_fields_set: config.json writes every key, the betas at their defaults included.
        fields = type(self).model_fields
        stray = [key for key in ("beta1", "beta2") if getattr(self, key) != fields[key].default]
        if stray and not self.bias_correction:
            raise ValueError(
                f"{' and '.join(stray)} only set Adam's bias correction: add bias_correction = true, or remove them"
            )
        return self


def build_clip_by_global_norm(config: ClipByGlobalNormConfig) -> server.UpdateTransformation:
    return server.clip_by_global_norm(config.max_norm)


def build_scale_by_momentum(config: ScaleByMomentumConfig) -> server.UpdateTransformation:
    return server.scale_by_momentum(config.beta, config.nesterov)


def build_scale_by_adam(config: ScaleByAdamConfig) -> server.UpdateTransformation:
    return server.scale_by_second_moment(server.exponential_average(config.beta2), config.beta1, config.epsilon)


def build_scale_by_adagrad(config: ScaleByAdagradConfig) -> server.UpdateTransformation:
    return server.scale_by_second_moment(server.running_sum, config.beta1, config.epsilon, config.initial_accumulator)


def build_scale_by_yogi(config: ScaleByYogiConfig) -> server.UpdateTransformation:
    return server.scale_by_second_moment(
        server.yogi_step(config.beta2), config.beta1, config.epsilon, config.initial_accumulator
    )


def build_scale_by_learning_rate(config: ScaleByLearningRateConfig) -> server.UpdateTransformation:
    correction = server.adam_bias_correction(config.beta1, config.beta2) if config.bias_correction else None
    return server.scale_by_learning_rate(correction)


# ---------------------------------------------------------------- a chain stated in TOML


def _stages(transforms: tuple) -> list[server.UpdateTransformation]:
    return [TRANSFORMATIONS.entries[stage.name].build(stage) for stage in transforms]


class ChainConfig(ServerOptimizerConfig):
    optimizer: Literal["chain"] = Field(
        "chain", description="the transformations of server.transforms, in order, then θ ← θ − u (optax-style)"
    )
    transforms: Transformations = Field(
        default_factory=lambda: (ScaleByLearningRateConfig(),),
        description="the stages, each a table {name = ..., its keys}: [[server.transforms]] "
        'name = "scale_by_momentum" beta = 0.9; exactly one applies server.lr (scale_by_learning_rate); '
        "`driftlab config` lists each stage's keys",
    )

    @model_validator(mode="after")
    def _stages_keep_distinct_state(self) -> "ChainConfig":
        # Each stateful stage keeps its state under fixed names (velocity, first_moment, ...): two of a kind would
        # overwrite each other's, which chain() refuses; say which stages instead of its generic message.
        owners: dict[str, str] = {}
        for index, (stage, built) in enumerate(zip(self.transforms, _stages(self.transforms), strict=True), start=1):
            for field in built.init(torch.zeros(1)):
                if field in owners:
                    raise ValueError(
                        f"server.transforms: stage {index} ({stage.name}) keeps its state under {field!r}, "
                        f"as {owners[field]} does: a chain takes each stateful stage once"
                    )
                owners[field] = f"stage {index} ({stage.name})"
        return self


def build_chain(section: ChainConfig) -> server.ServerOptimizer:
    return server.chain(*_stages(section.transforms), name="chain")


OPTIMIZERS = (
    ServerOptimizerEntry("sgd", SgdConfig, build_sgd, label="SGD"),
    ServerOptimizerEntry("momentum", MomentumConfig, build_momentum, label="momentum"),
    ServerOptimizerEntry("adam", AdamConfig, build_adam, label="Adam"),
    ServerOptimizerEntry("adagrad", AdagradConfig, build_adagrad, label="Adagrad"),
    ServerOptimizerEntry("yogi", YogiConfig, build_yogi, label="Yogi"),
    ServerOptimizerEntry("chain", ChainConfig, build_chain, label="a chain of transformations"),
)

STAGES = (
    TransformationEntry("clip_by_global_norm", ClipByGlobalNormConfig, build_clip_by_global_norm),
    TransformationEntry("scale_by_momentum", ScaleByMomentumConfig, build_scale_by_momentum),
    TransformationEntry("scale_by_adam", ScaleByAdamConfig, build_scale_by_adam),
    TransformationEntry("scale_by_adagrad", ScaleByAdagradConfig, build_scale_by_adagrad),
    TransformationEntry("scale_by_yogi", ScaleByYogiConfig, build_scale_by_yogi),
    TransformationEntry(
        "scale_by_learning_rate", ScaleByLearningRateConfig, build_scale_by_learning_rate, applies_lr=True
    ),
)
