"""What XLA makes of a Keras training step on JAX: HLO, memory, compiles.

The benchmarks compare keras_tp with `keras.distribution.ModelParallel`
by what runs, not by what either library says it runs: the collectives in
the compiled HLO, the compiled step's own memory analysis, and how often
`fit()` compiled the step.
"""

import collections
import contextlib
import re

import jax
import keras

HLO_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


def compiled_train_step(model, x, y, distribution=None):
    """Keras' training step of `model`, jitted as `fit()` jits it, compiled.

    This mirrors `JAXTrainer.make_train_function`: the state is donated
    and, under a distribution, the outputs keep the state's layouts. The
    model must have trained one step (so its optimizer is built).

    Args:
        model: a compiled Keras model (or `TensorParallelKeras`).
        x, y: one batch.
        distribution: the `keras.distribution` the model was made under.

    Returns:
        The `jax.stages.Compiled` step.
    """
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        out_shardings = None
        if distribution is not None:
            out_shardings = (None, model._get_state_sharding_spec())
        step = jax.jit(
            model.train_step, donate_argnums=0, out_shardings=out_shardings
        )
        return step.lower(state, (x, y)).compile()


def hlo_collectives(compiled):
    """Tensors each kind of HLO collective moves in a compiled program.

    XLA combines independent collectives into one op with several
    operands, so operands are counted as well as ops.

    Returns:
        `{kind: {"ops": n, "tensors": n}}`.
    """
    text = compiled.as_text()
    counts = {}
    for kind in HLO_COLLECTIVES:
        calls = re.findall(rf"\s{kind}(?:-start)?\(([^)]*)\)", text)
        counts[kind] = {
            "ops": len(calls),
            "tensors": sum(operands.count("%") for operands in calls),
        }
    return counts


def hlo_op_counts(compiled, kinds=("copy", "transpose", "fusion")):
    """How many instructions of each of `kinds` the compiled program has."""
    text = compiled.as_text()
    return {
        kind: len(re.findall(rf"=\s*\S+\s+{kind}\(", text)) for kind in kinds
    }


def step_memory(compiled):
    """Bytes of one device's compiled step, from XLA's memory analysis.

    Returns:
        `{"arguments", "outputs", "aliased", "temporaries", "peak"}`, where
        peak = arguments + outputs - aliased (donated state updated in
        place) + temporaries: what the step needs at once on a device.
    """
    analysis = compiled.memory_analysis()
    arguments = int(analysis.argument_size_in_bytes)
    outputs = int(analysis.output_size_in_bytes)
    aliased = int(analysis.alias_size_in_bytes)
    temporaries = int(analysis.temp_size_in_bytes)
    return {
        "arguments": arguments,
        "outputs": outputs,
        "aliased": aliased,
        "temporaries": temporaries,
        "peak": arguments + outputs - aliased + temporaries,
    }


class CompileCounter:
    """Counts XLA compilations of Keras' training step, with their seconds.

    JAX reports every backend compilation to `jax.monitoring` listeners
    with the jitted function's name; a step that `fit()` compiles more than
    once (inputs whose shardings changed between calls) shows here.
    """

    def __init__(self):
        self.seconds = collections.defaultdict(list)
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.seconds[kwargs.get("fun_name", "")].append(duration)

    def train_step_compiles(self):
        """How many times a `train_step` was compiled so far."""
        return sum(
            len(times)
            for name, times in self.seconds.items()
            if "train_step" in name
        )


def bytes_per_device(variables):
    """`{device: bytes}` of the variables, read from their shards.

    The same measure for keras_tp and for `ModelParallel` models: each
    array's `addressable_shards`, which hold what each device stores.
    """
    totals = collections.Counter()
    for variable in variables:
        value = variable.value
        if not isinstance(value, jax.Array):
            value = keras.ops.convert_to_tensor(value)
        for shard in value.addressable_shards:
            totals[str(shard.device)] += shard.data.nbytes
    return dict(totals)
