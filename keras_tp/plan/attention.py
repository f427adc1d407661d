"""Attention layers split by heads, as one region."""

import keras

from keras_tp.keras_internals import ATTENTION_OUTPUT_PROJECTION
from keras_tp.keras_internals import attention_projections
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row


class AttentionUnit:
    """MultiHeadAttention / GroupQueryAttention as one sharded region.

    Query, key, value (and gate) projections are Column on the heads axis,
    the output projection is Row, and the attention core between them runs
    unchanged on each rank's heads. So the block costs one all-reduce
    forward (after the output projection) and one backward (for the input).
    """

    layer_types = (
        keras.layers.MultiHeadAttention,
        keras.layers.GroupQueryAttention,
    )

    def matches(self, layer):
        return isinstance(layer, self.layer_types)

    def projections(self, layer):
        """`{attribute: sublayer}` of the projections, column ones first."""
        return attention_projections(layer)

    def heads(self, layer):
        """`(query_heads, key_value_heads)`."""
        if isinstance(layer, keras.layers.GroupQueryAttention):
            return layer.num_query_heads, layer.num_key_value_heads
        return layer.num_heads, layer.num_heads

    @staticmethod
    def projection_style(name):
        """The style of projection `name` when the unit is sharded."""
        return Row() if name == ATTENTION_OUTPUT_PROJECTION else Column()

    def output_axes(self, layer, kwargs):
        """Output axes: the scores, if returned, stay split on heads."""
        if kwargs.get("return_attention_scores"):
            return (None, 1)
        return None


ATTENTION = AttentionUnit()
