"""Memory per device of a plan, from shapes alone: no device is needed.

`keras-tp plan` prints it; the ZeRO formulas are those of the ZeRO paper
(Rajbhandari et al., 2020) for Adam's two slots.
"""

import math

from keras_tp.plan.report import split_variable_table
from keras_tp.plan.sharding_plan import walk_layers
from keras_tp.tensors import nbytes

ZERO_STAGES = (0, 1, 2, 3)
ADAM_SLOTS = 2


def zero_memory(trainable, frozen, data_parallel, zero_stage):
    """Bytes per device of parameters, gradients and Adam state under ZeRO.

    The ZeRO paper's formulas with `P = trainable` and `D = data_parallel`:
    stage 0 keeps `P + P + 2P` (parameters, gradients, Adam's two slots),
    stage 1 partitions the Adam state (`P + P + 2P/D`), stage 2 also the
    gradients (`P + P/D + 2P/D`), stage 3 also the parameters
    (`(P + P + 2P)/D`). Frozen variables have no gradient or Adam state and
    are never partitioned.

    Args:
        trainable: bytes of trainable parameters one model rank holds.
        frozen: bytes of non-trainable variables one model rank holds.
        data_parallel: number of data-parallel replicas, `D`.
        zero_stage: 0 (no ZeRO) to 3.

    Returns:
        `{"parameters", "gradients", "adam", "total", "between_steps"}` in
        bytes: `total` is the paper's, with the gradients of a step;
        `between_steps` what a `CoordinatedOptimizer` keeps from one step
        to the next without gradient accumulation, the parameters and the
        Adam state (a step's gradients live only in the step).

    Example:

    >>> zero_memory(1000, 0, data_parallel=4, zero_stage=1)["total"]
    2500
    """

    def partitioned(nbytes, from_stage):
        if zero_stage >= from_stage:
            return math.ceil(nbytes / data_parallel)
        return nbytes

    memory = {
        "parameters": partitioned(trainable, 3) + frozen,
        "gradients": partitioned(trainable, 2),
        "adam": partitioned(ADAM_SLOTS * trainable, 1),
    }
    memory["total"] = sum(memory.values())
    memory["between_steps"] = memory["parameters"] + memory["adam"]
    return memory


class PlanReport:
    """Local shapes and bytes per device of a model under a bound plan.

    Everything is derived from the plan and the variables' full shapes, so
    no device is needed.

    Args:
        model: the Keras model the plan is bound to.
        plan: a bound `keras_tp.ShardingPlan`.
        data_parallel: number of data-parallel replicas (ZeRO's `D`).
    """

    def __init__(self, model, plan, data_parallel):
        self.model = model
        self.plan = plan
        self.data_parallel = data_parallel
        self.split_axes = {
            id(variable): axis for variable, axis in plan.split_variables()
        }

    def local_shape(self, variable):
        """The shape of one tensor-parallel rank's shard of `variable`."""
        shape = list(variable.shape)
        axis = self.split_axes.get(id(variable))
        if axis is not None:
            shape[axis] //= self.plan.tensor_parallel
        return tuple(shape)

    def local_bytes(self, variables, split=True):
        """Bytes of `variables` on one model rank (`split=False`: unsplit)."""
        return sum(
            nbytes(v, self.local_shape(v) if split else None) for v in variables
        )

    def layer_table(self):
        """Per split layer: variable, style, local shape, bytes/device."""
        lines = split_variable_table(self.plan, self.local_shape)
        listed = {
            id(variable)
            for entry in self.plan.leaf_layers()
            for variable in entry.handler.variables(entry.layer).values()
        }
        if self.plan.replicated:
            lines.append("Replicated (whole on every device):")
            layers = {layer.path: layer for layer in walk_layers(self.model)}
            paths = self.plan.replicated
            for path, reason in paths.items():
                # A whole attention layer is listed with its projections'
                # bytes and its own reason, not projection by projection.
                if any(path.startswith(parent + "/") for parent in paths):
                    continue
                variables = [
                    v for v in layers[path].weights if id(v) not in listed
                ]
                size = self.local_bytes(variables)
                lines.append(f"  {path} ({size:,} B): {reason}")
        return "\n".join(lines)

    def memory(self, zero_stage):
        """`zero_memory()` of one device of this plan at `zero_stage`."""
        return zero_memory(
            self.local_bytes(self.model.trainable_variables),
            self.local_bytes(self.model.non_trainable_variables),
            self.data_parallel,
            zero_stage,
        )

    def memory_table(self, zero_stage):
        """The memory per device of ZeRO stages 0 to 3, as text."""
        one_device = zero_memory(
            self.local_bytes(self.model.trainable_variables, split=False),
            self.local_bytes(self.model.non_trainable_variables, split=False),
            data_parallel=1,
            zero_stage=0,
        )
        trainable = self.local_bytes(self.model.trainable_variables)
        header = (
            f"{'ZeRO stage':12} {'Parameters':>14} {'Gradients':>14} "
            f"{'Adam state':>14} {'Total':>14} {'Between steps':>14}"
        )
        lines = [
            "Bytes per device with Adam (2 slots), from the ZeRO formulas:",
            f"  P = {trainable:,} B of trainable parameters per "
            f"tensor-parallel rank, D = {self.data_parallel} data-parallel "
            "replicas",
            "  stage 0: P + P + 2P   stage 1: P + P + 2P/D   "
            "stage 2: P + P/D + 2P/D   stage 3: (P + P + 2P)/D",
            "  Between steps: without gradient accumulation, the parameters "
            "and the Adam state (a step's gradients live in the step)",
            header,
            "-" * len(header),
        ]
        for stage in (*ZERO_STAGES, None):
            if stage is None:
                memory, label = one_device, "one device"
            else:
                memory = self.memory(stage)
                label = f"{stage} (off)" if stage == 0 else str(stage)
            marker = "  <- --zero-stage" if stage == zero_stage else ""
            lines.append(
                f"{label:12} {memory['parameters']:>14,} "
                f"{memory['gradients']:>14,} {memory['adam']:>14,} "
                f"{memory['total']:>14,} {memory['between_steps']:>14,}"
                f"{marker}"
            )
        return "\n".join(lines)
