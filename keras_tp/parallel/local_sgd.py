"""Local SGD and DiLoCo: data-parallel replicas that synchronise rarely.

`LocalSGD` is the strategy a `CoordinatedOptimizer` holds for
`local_sgd_steps`; `GradientAccumulation` (`accumulation.py`) is the one
that synchronises the gradients of every update instead. Both have the
same interface: `bind`, `build`, `apply`, `finish` and `synchronises`.
"""

import keras
from keras import ops

from keras_tp.errors import check_count
from keras_tp.keras_internals import place_slots_on_creation
from keras_tp.keras_internals import stateful_cond
from keras_tp.parallel.wrapping import WrappingOptimizer


class LocalSGD:
    """Updates each replica alone and synchronises every `steps` updates.

    Each data-parallel replica updates its own parameters from its own
    gradients, without communicating, and every `steps`-th update (when
    `iterations` divides by `steps`) the replicas synchronise their
    parameters with one all-reduce per bucket, `1 / steps` of DDP's
    traffic. The optimizer's state (momenta) stays each replica's own.
    `fit()` ends on a synchronisation, so the replicas agree afterwards.

    With an outer optimizer the synchronisation is a step of its own
    (DiLoCo, Douillard et al. 2023): it applies the replicas' mean move
    since the last synchronisation, `anchor - mean(parameters)`, as a
    gradient to the anchor (the parameters after the last
    synchronisation), and every replica starts from the new anchor.
    Without one the parameters are averaged (plain local SGD), which
    `keras.optimizers.SGD(1.0)` would do too.

    `CoordinatedOptimizer(local_sgd_steps=..., outer_optimizer=...)` makes
    one.

    Args:
        steps: updates between synchronisations (`local_sgd_steps`).
        outer_optimizer: a new Keras optimizer for DiLoCo's outer step, or
            `None` to average the parameters.

    Example:

    ```python
    # DiLoCo: 4 replicas step alone with AdamW and synchronise every 50
    # steps through an outer Nesterov SGD.
    tp = keras_tp.TensorParallelKeras(model, world_size=4, data_parallel=4)
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.AdamW(1e-3), local_sgd_steps=50,
        outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9,
                                             nesterov=True))
    tp.compile(optimizer=optimizer, loss="mse")
    ```
    """

    # Each replica updates its own parameters and keeps its own optimizer
    # state: norms are taken within the replica, slots are per replica.
    replica_local = True
    gradient_buffers = ()

    def __init__(self, steps, outer_optimizer=None):
        self.steps = steps
        self.outer_optimizer = outer_optimizer
        # With an outer optimizer: the parameters after the last
        # synchronisation.
        self.anchors = []

    @property
    def optimizers(self):
        """The Keras optimizers this strategy runs besides the inner one."""
        return [] if self.outer_optimizer is None else [self.outer_optimizer]

    def bind(self, placement, data_adapter, run_on_ranks):
        """Attaches the mesh; refuses one without a data axis.

        Args:
            placement: the `Placement` of the model's variables.
            data_adapter: the collective adapter of the `data` axis.
            run_on_ranks: the runtime's `run_on_ranks`, with which `finish`
                synchronises the replicas at the end of `fit()`.
        """
        if placement.data_parallel == 1:
            raise ValueError(
                "local_sgd_steps synchronises data-parallel replicas, but "
                "the model has data_parallel=1. Build the TensorParallelKeras "
                "model with data_parallel > 1, or pass local_sgd_steps=None."
            )
        self._placement = placement
        self._data_adapter = data_adapter
        self._run_on_ranks = run_on_ranks

    def build(self, optimizer, var_list, partition_axes):
        """Anchors and the outer optimizer's state; replica-local storage.

        No gradient is kept between steps: each replica applies its own at
        once. The parameters become replica-local, as the inner optimizer's
        slots did when they were made: their copies on the data ranks may
        differ.

        Args:
            optimizer: the `CoordinatedOptimizer`, which owns the anchors.
            var_list: the trainable variables.
            partition_axes: unused: local SGD runs without ZeRO, whose
                partitions `GradientAccumulation` places its buffers by.
        """
        placement = self._placement
        outer = self.outer_optimizer
        if outer is not None:
            for variable in var_list:
                anchor = optimizer.add_variable_from_reference(
                    variable, "anchor"
                )
                placement.place_like(anchor, variable)
                placement.assign_full_value(
                    anchor, placement.full_value(variable)
                )
                self.anchors.append(anchor)
            place_slots_on_creation(outer, placement.place_like)
            outer.build(self.anchors)
        for variable in var_list:
            placement.keep_per_replica(variable)

    def apply(self, optimizer, grads, variables):
        """This replica's update, and every `steps`-th a synchronisation.

        The synchronisation is a pure function of the variables' values
        (a traced `cond` on JAX and TensorFlow), so its collectives run
        only on synchronisation steps, and the stats count them only there.

        Args:
            optimizer: the `CoordinatedOptimizer` (`update_parameters`).
            grads: this replica's gradients of `variables`.
            variables: the trainable variables.
        """
        optimizer.update_parameters(grads)
        synchronising = ops.equal(ops.mod(optimizer.iterations, self.steps), 0)

        def synchronised_last():
            return self._synchronised_last(optimizer)

        with self._data_adapter.stats.conditional(synchronised_last):
            stateful_cond(
                synchronising,
                lambda: self._synchronise(optimizer, variables),
                lambda: None,
                self._touched(variables),
            )

    def finish(self, optimizer, variables):
        """Synchronises once more if the last update did not.

        Recorded under the phase `"final_sync"`, so the model `fit()`
        leaves is one model.
        """
        if self._synchronised_last(optimizer):
            return

        def synchronise():
            with self._data_adapter.stats.labelled("optimizer"):
                self._synchronise(optimizer, variables)

        self._run_on_ranks(synchronise, self._touched(variables), "final_sync")

    def synchronises(self, step):
        """Whether update number `step` synchronises the replicas."""
        return step % self.steps == 0

    def _synchronised_last(self, optimizer):
        step = int(ops.convert_to_numpy(optimizer.iterations))
        return self.synchronises(step)

    def _touched(self, variables):
        """What a synchronisation of `variables` reads and assigns."""
        touched = list(variables) + self.anchors
        if self.outer_optimizer is not None:
            touched += self.outer_optimizer.variables
        return touched

    def _synchronise(self, optimizer, variables):
        """Gives every replica the parameters of the synchronisation.

        Plain local SGD averages the parameters; DiLoCo averages the
        replicas' moves since the anchor, applies them to the anchor with
        the outer optimizer, and every replica takes the new anchor. Either
        way one all-reduce per bucket sends the parameters' bytes.
        """
        values = [v.value for v in variables]
        if self.outer_optimizer is None:
            averaged = self._averaged(optimizer, values, variables)
            for variable, mean in zip(variables, averaged):
                variable.assign(mean)
            return
        moves = [
            ops.subtract(anchor.value, value)
            for anchor, value in zip(self.anchors, values)
        ]
        self.outer_optimizer.apply(
            self._averaged(optimizer, moves, variables), self.anchors
        )
        for variable, anchor in zip(variables, self.anchors):
            variable.assign(anchor.value)

    def _averaged(self, optimizer, values, variables):
        """`values`, one per variable, averaged over the data axis."""
        out = list(values)
        for bucket in optimizer.buckets:
            bucket.all_reduce(values, variables, out, self._data_adapter)
        return out


def local_sgd(
    steps, outer, optimizer, zero_stage, compression, accumulation_steps
):
    """The `LocalSGD` of a `CoordinatedOptimizer`'s arguments, or `None`.

    Refuses the arguments that do not compose with local SGD.

    Args:
        steps: `local_sgd_steps`.
        outer: `outer_optimizer`.
        optimizer: the inner Keras optimizer.
        zero_stage: the ZeRO stage.
        compression: the `Compression`, or `None`.
        accumulation_steps: `gradient_accumulation_steps`.

    Returns:
        A `LocalSGD`, or `None` for `steps=None` (gradients synchronised
        at every update).
    """
    if steps is None:
        if outer is not None:
            raise ValueError(
                "outer_optimizer is the optimizer of local SGD's "
                "synchronisations: pass local_sgd_steps with it."
            )
        return None
    check_count(
        "local_sgd_steps", steps, hint=" (or None to synchronise every step)"
    )
    if zero_stage != 0:
        raise ValueError(
            f"local_sgd_steps needs zero_stage=0, got {zero_stage}: each "
            "replica keeps its whole parameters and optimizer state between "
            "synchronisations, which ZeRO would partition over the data "
            "axis. Build the model and the optimizer with zero_stage=0."
        )
    if compression is not None:
        raise ValueError(
            f"compression={compression.kind!r} does not apply to local SGD, "
            "which sends parameters every local_sgd_steps steps rather than "
            "gradients every step. Pass compression=None with "
            "local_sgd_steps."
        )
    if accumulation_steps != 1:
        raise ValueError(
            "gradient_accumulation_steps does not apply to local SGD, where "
            "each replica updates from its own gradients at every step. "
            "Pass gradient_accumulation_steps=1 and a larger batch (or more "
            "local_sgd_steps)."
        )
    if optimizer.use_ema:
        raise ValueError(
            f"Optimizer '{optimizer.name}' has use_ema=True, which local SGD "
            "does not support: each replica would average its own weights. "
            "Pass use_ema=False with local_sgd_steps."
        )
    if outer is not None:
        _check_outer(outer, optimizer)
    return LocalSGD(steps, outer)


def _check_outer(outer, optimizer):
    """Refuses an outer optimizer DiLoCo's outer step cannot run."""
    if not isinstance(outer, keras.optimizers.Optimizer) or isinstance(
        outer, (WrappingOptimizer, keras.optimizers.LossScaleOptimizer)
    ):
        raise TypeError(
            "outer_optimizer must be a keras.optimizers.Optimizer (such as "
            f"keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)), got "
            f"{type(outer)}."
        )
    if outer is optimizer or outer.built:
        raise ValueError(
            f"outer_optimizer '{outer.name}' is the inner optimizer or "
            "already built on other variables; give local SGD a new optimizer."
        )
    options = {
        "clipnorm": outer.clipnorm,
        "global_clipnorm": outer.global_clipnorm,
        "use_ema": outer.use_ema,
        "gradient_accumulation_steps": outer.gradient_accumulation_steps,
    }
    used = sorted(name for name, value in options.items() if value)
    if used:
        raise ValueError(
            f"outer_optimizer '{outer.name}' sets {used}, which the outer "
            "step of local SGD does not support; remove them (clipvalue "
            "and weight decay work)."
        )
