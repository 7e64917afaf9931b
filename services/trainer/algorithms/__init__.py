"""The algorithm API (docs/algorithms.md): a researcher's advantages and per-token loss, named in
config as `ppo.algorithm`, and the built-in algorithms the settings describe.

    from services.trainer.algorithms import AdvantageInput, LossInput, LossOutput, Standard

`Algorithm` is the protocol; `Standard` the settings-driven built-in to subclass."""

from services.trainer.algorithms.advantages import batch_normalise, group_advantages, reinforce_pp, returns_to_go
from services.trainer.algorithms.aggregation import AGGREGATIONS, aggregate
from services.trainer.algorithms.api import AdvantageInput, Algorithm, LossInput, LossOutput
from services.trainer.algorithms.kl import KL_ESTIMATORS, kl_estimate, kl_k1, kl_k2, kl_k3
from services.trainer.algorithms.losses import LossParts, clipped_objective, gspo_token_loss, ppo_token_loss
from services.trainer.algorithms.registry import AlgorithmError, load_algorithm
from services.trainer.algorithms.rewards import overlong_penalty, scale_rewards, shaped_rewards, token_rewards
from services.trainer.algorithms.standard import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, Standard

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInput",
    "Algorithm",
    "AlgorithmError",
    "LossInput",
    "LossOutput",
    "LossParts",
    "Standard",
    "aggregate",
    "batch_normalise",
    "clipped_objective",
    "group_advantages",
    "gspo_token_loss",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "load_algorithm",
    "overlong_penalty",
    "ppo_token_loss",
    "reinforce_pp",
    "returns_to_go",
    "scale_rewards",
    "shaped_rewards",
    "token_rewards",
]
