"""Per-example norms and clipping: ghost rules where a layer has one, vectorized_map elsewhere."""

from tf_dp.clipping import conv as _conv  # noqa: F401  (registers the Conv1D/Conv2D rule)
from tf_dp.clipping import dense as _dense  # noqa: F401  (registers the Dense rule)
from tf_dp.clipping import einsum_dense as _einsum_dense  # noqa: F401  (EinsumDense, so MultiHeadAttention)
from tf_dp.clipping import embedding as _embedding  # noqa: F401  (registers the Embedding rule)
from tf_dp.clipping import layer_normalization as _layer_norm  # noqa: F401  (LayerNormalization rule)
from tf_dp.clipping import reversible_embedding as _reversible_embedding  # noqa: F401  (keras-hub tied embeddings, by name)
from tf_dp.clipping import normalization as _normalization  # noqa: F401  (RMSNormalization, GroupNormalization, keras-hub norms)
from tf_dp.clipping import position_embedding as _position_embedding  # noqa: F401  (keras-hub PositionEmbedding, by name)
from tf_dp.clipping import depthwise_conv as _depthwise_conv  # noqa: F401  (DepthwiseConv2D rule)
from tf_dp.clipping import recurrent as _recurrent  # noqa: F401  (LSTM, GRU, SimpleRNN rule)
from tf_dp.clipping import op_rules as _op_rules  # noqa: F401  (op-level rule: layers without a registered one)
from tf_dp.clipping.adaptive import AdaptiveClip
from tf_dp.clipping.clip import clip_factors
from tf_dp.clipping.engine import CURRENT_WEIGHTS, ENGINES, ClippedBatch, EvaluationPoint, clipped_gradient_sum, forward
from tf_dp.clipping.norms import per_example_gradient_norms
from tf_dp.clipping.per_example import per_example_gradients
from tf_dp.clipping.policy import (ClippingPolicy, FlatClip, Normalized, PerLayer, register_clipping,
                                   resolve_clipping)
from tf_dp.clipping.registry import (Contribution, GhostRule, LayerRegistry, Recording, default_layer_registry,
                                     ghost_rule_for, register_ghost_rule)

__all__ = [
    "AdaptiveClip", "ClippingPolicy", "FlatClip", "Normalized", "PerLayer", "register_clipping", "resolve_clipping",
    "CURRENT_WEIGHTS", "ENGINES", "ClippedBatch", "EvaluationPoint", "forward", "Contribution", "GhostRule",
    "LayerRegistry", "Recording", "clip_factors", "default_layer_registry", "clipped_gradient_sum", "ghost_rule_for",
    "per_example_gradient_norms",
    "per_example_gradients", "register_ghost_rule",
]
