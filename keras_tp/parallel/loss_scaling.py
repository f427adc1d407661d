"""Dynamic loss scaling (`mixed_float16`) that every rank decides alike.

Keras' `LossScaleOptimizer` skips a step, and halves its scale, when the
gradients it holds are not all finite. Where each rank holds its own
gradients (a shard's, or a data-parallel row's before they are averaged),
one rank's overflow would make it alone skip: its scale and weights would
part from the others', and a data-parallel rank would leave the others
waiting in the gradients' all-reduce. Here the ranks count their
non-finite entries together, so all of them skip or none does.
"""

import keras
from keras import ops


class GlobalLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """A `LossScaleOptimizer` whose finiteness check spans every rank.

    `TensorParallelKeras.compile()` makes one where each rank computes
    its own gradients: from a `LossScaleOptimizer` given to it, or, as
    Keras does, around the optimizer of a model whose dtype policy is
    `mixed_float16`.

    Args:
        inner_optimizer: the optimizer that updates the variables (a
            `CoordinatedOptimizer` with a data axis).
        world: the collective adapter over every rank of the mesh.
        **kwargs: `keras.optimizers.LossScaleOptimizer`'s arguments.
    """

    def __init__(self, inner_optimizer, world, **kwargs):
        super().__init__(inner_optimizer, **kwargs)
        self._world = world

    def apply(self, grads, trainable_variables=None):
        """Applies the unscaled `grads` where every rank's are finite, and
        grows or halves the scale, as `LossScaleOptimizer` does, in the
        replica step itself: the ranks' decision is already one (no
        TensorFlow `merge_call`)."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        ops.cond(
            self.check_finite(grads),
            lambda: self._apply_unscaled(grads, trainable_variables),
            self._halve_scale,
        )

    def _apply_unscaled(self, grads, trainable_variables):
        variables = trainable_variables or [None] * len(grads)
        scale = self.dynamic_scale
        # Reshaped: a TensorFlow embedding's sparse gradient divides into
        # a dense one whose rows are unknown until it runs.
        unscaled = [
            g
            if g is None or getattr(v, "overwrite_with_gradient", False)
            else ops.reshape(ops.divide(g, scale), tuple(g.shape))
            for g, v in zip(grads, variables)
        ]
        self.inner_optimizer.apply(unscaled, trainable_variables)
        self._move_scale(True)

    def _halve_scale(self):
        self._move_scale(False)

    def _move_scale(self, finite):
        new = next_scale(self, finite, self.dynamic_scale, self.step_counter)
        self.dynamic_scale.assign(new[0])
        self.step_counter.assign(new[1])

    def check_finite(self, grads):
        """Whether every rank's `grads` are all finite: one all-reduce of
        their counts of entries that are not."""
        counts = [
            ops.sum(ops.cast(ops.logical_not(ops.isfinite(g)), "float32"))
            for g in grads
            if g is not None
        ]
        local = ops.sum(ops.stack(counts)) if counts else ops.zeros(())
        with self._world.stats.labelled("optimizer"):
            total = self._world.all_reduce(local, "sum")
        return ops.equal(total, 0.0)


def next_scale(optimizer, finite, scale, counter):
    """`(scale, counter)` after a step, as `LossScaleOptimizer` moves
    them: halved, and the count of finite steps restarted, where the
    gradients were not `finite` (a bool, or a boolean tensor); doubled
    once `dynamic_growth_steps` steps in a row were finite."""
    grows = ops.logical_and(
        finite, ops.equal(counter, optimizer.dynamic_growth_steps - 1)
    )
    zero = ops.zeros_like(counter)
    return (
        ops.where(
            finite,
            ops.where(grows, ops.multiply(scale, 2.0), scale),
            ops.multiply(scale, 0.5),
        ),
        ops.where(finite, ops.where(grows, zero, ops.add(counter, 1)), zero),
    )


def unscaled(optimizer):
    """The optimizer a `LossScaleOptimizer` wraps; any other itself."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def loss_scale(optimizer):
    """The factor a `LossScaleOptimizer` scales the loss by now (its
    dynamic scale), `None` for any other optimizer."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale
    return None


def scaled_loss_optimizer(
    optimizer, trainer, runtime, coordinate, auto_scale_loss=True
):
    """`optimizer` with the loss scaling `compile()` gives it.

    Args:
        optimizer: the optimizer given to `compile()`.
        trainer: the `TensorParallelKeras` being compiled.
        runtime: its runtime.
        coordinate: a function of an optimizer, and of whether the loss
            is scaled, returning it as the runtime updates with it
            (`compiling.coordinated`).
        auto_scale_loss: `compile()`'s argument of that name.

    Returns:
        A `GlobalLossScaleOptimizer` around the coordinated optimizer
        where ranks compute their own gradients and the loss is scaled (a
        `LossScaleOptimizer` given, or a `mixed_float16` model compiled
        with `auto_scale_loss`); else `coordinate(optimizer, False)`.
    """
    given = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    automatic = auto_scale_loss and trainer.dtype_policy.name == (
        "mixed_float16"
    )
    # One process's pipelines (JAX, TensorFlow) decide for all stages
    # themselves: they have no adapter over every rank.
    world = getattr(runtime, "world_adapter", None)
    if not runtime.local_ranks or world is None or not (given or automatic):
        return coordinate(optimizer, False)
    if given:
        options = {
            "initial_scale": optimizer.initial_scale,
            "dynamic_growth_steps": optimizer.dynamic_growth_steps,
            "name": optimizer.name,
        }
        optimizer = optimizer.inner_optimizer
    else:
        options = {"name": "loss_scale_optimizer"}
    inner = keras.optimizers.get(coordinate(optimizer, True))
    return GlobalLossScaleOptimizer(inner, world, **options)
