"""Fallback for layers without a ghost rule: per-example gradients of that layer only.

The layer's recorded inputs and output gradients s_i come from the shared batch
forward/backward pass; ``tf.vectorized_map`` then replays just this layer on each example
and takes its vector-Jacobian product with s_i, giving ∂ℓ_i/∂θ_layer explicitly. Cost is
per-example in this layer only, not in the whole model. Valid for layers whose output row
i depends only on input row i (layers that mix examples are refused by the model check).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.clipping import rounding
from tf_dp.clipping.clip import weighted_row_sum
from tf_dp.clipping.kernels import require_grouped_conv_kernels
from tf_dp.clipping.registry import Contribution, GhostRule, Recording


def squared_row_norms(per_example: tf.Tensor) -> tf.Tensor:
    """An upper bound on Σ_j g_ij² per row of a [P, ...] tensor, float64 (rounding.squared_sum)."""
    return rounding.squared_sum(tf.reshape(per_example, [tf.shape(per_example)[0], -1]))


def _is_batched_tensor(value) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank is not None and value.shape.rank >= 1


class MaterializedContribution(Contribution):
    """Per-example gradients held explicitly: one [P, *shape] tensor per variable."""

    def __init__(self, per_example_grads: list[tf.Tensor]):
        self.per_example_grads = [tf.cast(g, tf.float32) for g in per_example_grads]

    def squared_norms(self):
        """Σ ĝ_i² bounded above (all terms positive: relative error ≤ γ_{n+1}): the squared
        norm of exactly what is released, c_i ĝ_i."""
        return tf.add_n([squared_row_norms(g) for g in self.per_example_grads])

    def weighted_sums(self, clip_factors):
        return [weighted_row_sum(clip_factors, g) for g in self.per_example_grads]


class LayerPerExampleRule(GhostRule):
    """Records (args, kwargs, outputs); per-example gradients by vectorized replay."""

    def __init__(self, tap):
        self._tap = tap

    def variables(self, layer):
        # Keras keeps a variable in _trainable_variables after `v.trainable = False`
        # (e.g. a LoRA-frozen kernel): only trainable ones enter the per-example norm.
        return [v for v in layer._trainable_variables if v.trainable]

    def tapped_call(self, layer, original_call, recordings, *args, **kwargs):
        # The weight values in effect (possibly a perturbed point under a StatelessScope):
        # the replay must differentiate the layer at exactly these values.
        values = [tf.convert_to_tensor(v.value) for v in self.variables(layer)]
        outputs = original_call(*args, **kwargs)
        recordings.append(Recording((args, kwargs), tf.nest.flatten(outputs), extras=(original_call, values)))
        return outputs

    def contribution(self, layer, recordings, output_grads):
        require_grouped_conv_kernels([layer], f"The per-example replay of layer {layer.name!r} (no ghost rule applies)")
        variables = self.variables(layer)
        total = None
        for recording, grads in zip(recordings, output_grads):
            per_example = self._replay(recording, grads, variables)
            total = per_example if total is None else [a + b for a, b in zip(total, per_example)]
        return MaterializedContribution(total)

    def _replay(self, recording: Recording, grads, variables):
        (args, kwargs), (original_call, values) = recording.inputs, recording.extras
        grads = [tf.zeros_like(w) if g is None else g for g, w in zip(grads, recording.watched)]
        flat_inputs = tf.nest.flatten((args, kwargs))
        batched = [i for i, v in enumerate(flat_inputs) if _is_batched_tensor(v)]

        def one_example(elems):
            example_inputs, example_grads = elems
            flat = list(flat_inputs)
            for index, value in zip(batched, example_inputs):
                flat[index] = value[None]
            call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), flat)
            with self._tap.paused(), tf.GradientTape() as tape:
                tape.watch(values)
                with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                    outputs = tf.nest.flatten(original_call(*call_args, **call_kwargs))
            vjp = tape.gradient(outputs, values, output_gradients=[g[None] for g in example_grads])
            return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(vjp, variables)]

        return tf.vectorized_map(one_example, ([flat_inputs[i] for i in batched], grads))
