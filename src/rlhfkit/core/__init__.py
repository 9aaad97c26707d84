"""Core math of RLHF: pure functions over tensors, importing only torch. Shapes: ``B`` batch,
``T`` sequence, ``R`` response, ``V`` vocabulary, ``G`` group; ``response_mask [B, R]`` is 1 up to
and including the first EOS. Reductions are masked (an empty mask is an error, not NaN); losses
return ``(loss, stats)``, detached scalars named as the logged metrics."""

from .advantages import (
    gae,
    group_advantages,
    group_mean_se,
    reinforce_advantages,
    rloo_advantages,
    scale_advantages,
    zero_std_groups,
)
from .losses import (
    AGGREGATIONS,
    POLICY_OBJECTIVES,
    Aggregation,
    SurrogateOptions,
    aggregate,
    aggregation_count,
    policy_loss,
    policy_objective,
    sampling_correction_weights,
    sequence_log_ratio,
    value_loss,
)
from .preference import bradley_terry_loss, dpo_loss, ipo_loss
from .rewards import adaptive_kl_coef, kl_estimate, kl_from_logits, overlong_penalty, shaped_rewards
from .stats import (
    entropy_from_logits,
    explained_variance,
    last_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    position_ids_from_mask,
)

__all__ = [
    "AGGREGATIONS", "POLICY_OBJECTIVES", "Aggregation", "SurrogateOptions", "adaptive_kl_coef", "aggregate",
    "aggregation_count", "bradley_terry_loss", "dpo_loss", "entropy_from_logits", "explained_variance", "gae",
    "group_advantages", "group_mean_se", "ipo_loss", "kl_estimate", "kl_from_logits", "last_token_index",
    "logprobs_from_logits", "masked_mean", "masked_sum", "masked_var", "masked_whiten", "overlong_penalty",
    "policy_loss", "policy_objective", "position_ids_from_mask", "reinforce_advantages", "rloo_advantages",
    "sampling_correction_weights", "scale_advantages", "sequence_log_ratio", "shaped_rewards",
    "value_loss", "zero_std_groups",
]
