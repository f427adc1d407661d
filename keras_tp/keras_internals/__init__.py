"""Every use of Keras internals, in one place.

keras_tp reaches below Keras' public API where it must: a rank holds
slices of variables that Keras believes whole, and a split layer runs
inside Keras' own call machinery. This package is the only code that
imports `keras.src` or reads private Keras attributes, so a Keras upgrade
is audited here. Its modules go by what they reach into:

- `scopes`: values bound to variables (`bind_values`), so that Keras' own
  code computes on a rank's shards, and reads of variables watched
  (`ReadWatcher`);
- `variables`: a variable's storage, reported shape and JAX layout;
- `layers`: what a layer tracks (variables, sublayers, seed generators),
  attention projections, masks;
- `optimizers`: slots, optimizer variables and update hooks;
- `models`: a compiled model's loss, metrics and inputs;
- `graphs`: the nodes of a Functional model's graph.

Everything is importable from the package itself:
`from keras_tp.keras_internals import bind_values`.
"""

from keras_tp.keras_internals.graphs import graph_constants
from keras_tp.keras_internals.graphs import is_input_node
from keras_tp.keras_internals.graphs import layer_call_nodes
from keras_tp.keras_internals.graphs import node_call_arguments
from keras_tp.keras_internals.graphs import node_filled_arguments
from keras_tp.keras_internals.graphs import node_inputs
from keras_tp.keras_internals.graphs import node_operation
from keras_tp.keras_internals.graphs import node_outputs
from keras_tp.keras_internals.graphs import producer_node
from keras_tp.keras_internals.layers import ATTENTION_OUTPUT_PROJECTION
from keras_tp.keras_internals.layers import added_loss_count
from keras_tp.keras_internals.layers import adds_loss_in_call
from keras_tp.keras_internals.layers import attention_projections
from keras_tp.keras_internals.layers import batch_moments
from keras_tp.keras_internals.layers import calls_layers_for_kernel_reads
from keras_tp.keras_internals.layers import clear_added_losses
from keras_tp.keras_internals.layers import draw_from_state
from keras_tp.keras_internals.layers import get_keras_mask
from keras_tp.keras_internals.layers import keras_reshape
from keras_tp.keras_internals.layers import own_seed_generators
from keras_tp.keras_internals.layers import own_trainable_variables
from keras_tp.keras_internals.layers import own_variables
from keras_tp.keras_internals.layers import reads_as_matmul
from keras_tp.keras_internals.layers import reduction_axes
from keras_tp.keras_internals.layers import reshape_through
from keras_tp.keras_internals.layers import seed_generators
from keras_tp.keras_internals.layers import set_batch_moments
from keras_tp.keras_internals.layers import set_keras_mask
from keras_tp.keras_internals.layers import shifted_seed_draws
from keras_tp.keras_internals.layers import stored_kernel
from keras_tp.keras_internals.layers import sublayers
from keras_tp.keras_internals.layers import take_added_losses
from keras_tp.keras_internals.models import BuildsBeforeTracing
from keras_tp.keras_internals.models import RunsModelsOwnLoss
from keras_tp.keras_internals.models import attach_trainer_state
from keras_tp.keras_internals.models import build_shapes
from keras_tp.keras_internals.models import compile_arguments
from keras_tp.keras_internals.models import compiled_loss
from keras_tp.keras_internals.models import compiled_user_losses
from keras_tp.keras_internals.models import compute_loss
from keras_tp.keras_internals.models import input_structure
from keras_tp.keras_internals.models import jax_update_metrics
from keras_tp.keras_internals.models import loss_function_arguments
from keras_tp.keras_internals.models import losses_override
from keras_tp.keras_internals.models import map_added_losses
from keras_tp.keras_internals.models import metric_function
from keras_tp.keras_internals.models import overrides_compute_loss
from keras_tp.keras_internals.models import print_msg
from keras_tp.keras_internals.models import set_initial_epoch
from keras_tp.keras_internals.models import set_metric_function
from keras_tp.keras_internals.models import tracked_loss
from keras_tp.keras_internals.models import update_loss_tracker
from keras_tp.keras_internals.models import wrapped_loss_function
from keras_tp.keras_internals.optimizers import UpdatesThroughAssign
from keras_tp.keras_internals.optimizers import accumulated_gradient
from keras_tp.keras_internals.optimizers import average_weights
from keras_tp.keras_internals.optimizers import (
    backend_free_add_variable_from_reference,
)
from keras_tp.keras_internals.optimizers import clipping_by
from keras_tp.keras_internals.optimizers import exclude_from_weight_decay
from keras_tp.keras_internals.optimizers import linear_momentum
from keras_tp.keras_internals.optimizers import mix_in
from keras_tp.keras_internals.optimizers import mixed_class
from keras_tp.keras_internals.optimizers import model_variables_of
from keras_tp.keras_internals.optimizers import moving_average
from keras_tp.keras_internals.optimizers import own_optimizer_variables
from keras_tp.keras_internals.optimizers import per_variable_update_steps
from keras_tp.keras_internals.optimizers import place_slots_on_creation
from keras_tp.keras_internals.optimizers import schedule_at_micro_steps
from keras_tp.keras_internals.optimizers import slot_of
from keras_tp.keras_internals.optimizers import step_counter
from keras_tp.keras_internals.optimizers import untracked_variables
from keras_tp.keras_internals.optimizers import updating_only
from keras_tp.keras_internals.optimizers import weight_decay_excluded
from keras_tp.keras_internals.scopes import ReadWatcher
from keras_tp.keras_internals.scopes import StatelessScope
from keras_tp.keras_internals.scopes import bind_values
from keras_tp.keras_internals.scopes import get_stateless_scope
from keras_tp.keras_internals.scopes import holds_values
from keras_tp.keras_internals.scopes import in_symbolic_scope
from keras_tp.keras_internals.scopes import local_shapes
from keras_tp.keras_internals.scopes import stateful_cond
from keras_tp.keras_internals.variables import direct_assign
from keras_tp.keras_internals.variables import jax_layout
from keras_tp.keras_internals.variables import set_jax_layout
from keras_tp.keras_internals.variables import set_reported_shape
from keras_tp.keras_internals.variables import set_stored_value
from keras_tp.keras_internals.variables import stored_value

__all__ = [
    "ATTENTION_OUTPUT_PROJECTION",
    "BuildsBeforeTracing",
    "ReadWatcher",
    "RunsModelsOwnLoss",
    "StatelessScope",
    "UpdatesThroughAssign",
    "accumulated_gradient",
    "added_loss_count",
    "adds_loss_in_call",
    "attach_trainer_state",
    "attention_projections",
    "average_weights",
    "backend_free_add_variable_from_reference",
    "batch_moments",
    "bind_values",
    "build_shapes",
    "calls_layers_for_kernel_reads",
    "clear_added_losses",
    "clipping_by",
    "compile_arguments",
    "compiled_loss",
    "compiled_user_losses",
    "compute_loss",
    "direct_assign",
    "draw_from_state",
    "exclude_from_weight_decay",
    "get_keras_mask",
    "get_stateless_scope",
    "holds_values",
    "in_symbolic_scope",
    "graph_constants",
    "input_structure",
    "is_input_node",
    "jax_layout",
    "jax_update_metrics",
    "keras_reshape",
    "layer_call_nodes",
    "linear_momentum",
    "local_shapes",
    "loss_function_arguments",
    "losses_override",
    "map_added_losses",
    "metric_function",
    "mix_in",
    "mixed_class",
    "model_variables_of",
    "moving_average",
    "node_call_arguments",
    "node_filled_arguments",
    "node_inputs",
    "node_operation",
    "node_outputs",
    "overrides_compute_loss",
    "own_optimizer_variables",
    "own_seed_generators",
    "own_trainable_variables",
    "own_variables",
    "per_variable_update_steps",
    "place_slots_on_creation",
    "print_msg",
    "producer_node",
    "reads_as_matmul",
    "reduction_axes",
    "reshape_through",
    "schedule_at_micro_steps",
    "seed_generators",
    "set_batch_moments",
    "set_initial_epoch",
    "set_jax_layout",
    "set_keras_mask",
    "set_metric_function",
    "set_reported_shape",
    "set_stored_value",
    "shifted_seed_draws",
    "slot_of",
    "stateful_cond",
    "step_counter",
    "stored_kernel",
    "stored_value",
    "sublayers",
    "take_added_losses",
    "tracked_loss",
    "untracked_variables",
    "update_loss_tracker",
    "updating_only",
    "weight_decay_excluded",
    "wrapped_loss_function",
]
