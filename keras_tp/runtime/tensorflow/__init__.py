"""TensorFlow runtime: the ranks are the replicas of a `tf.distribute` strategy.

On one host the strategy is a `tf.distribute.MirroredStrategy` over the
chosen devices (GPUs, or the virtual CPUs made by
`configure_virtual_devices`); across hosts it is the
`MultiWorkerMirroredStrategy` that `configure_multi_worker()` builds from
`TF_CONFIG`. DTensor is not used.

`TensorFlowRuntime` is put together from one mixin per part, along the
seams of Keras' own TensorFlow backend, with the same file names as the
other backends' runtimes:

- `devices`: the strategy, its replicas and the `data x model` mesh over
  them, with the collectives of each axis; running a function on every
  replica.
- `storage`: per-replica variables, each component holding its rank's
  shard; full values, saving and the bytes on each device.
- `steps`: Keras' train, test and predict steps, run by the runtime over
  the replicas; direct calls of the model.
- `optimizer`: each replica's update of its own shards (`ReplicaUpdates`),
  with the `TensorParallelOptimizer` mixin of the optimizer.
- `worker_rows`: the data-parallel rows of several workers, whose
  outputs (and, where each reads its share of the batch, targets) the
  steps gather over `data`.
- `regions`: sharded layers on a replica's local weights, or run as their
  own replica step outside a step; under sequence parallelism, their
  inputs gathered from `SequenceShard`s.
"""

from keras_tp.runtime.mesh import MeshRuntime
from keras_tp.runtime.tensorflow.devices import ReplicaDevices
from keras_tp.runtime.tensorflow.devices import configure_multi_worker
from keras_tp.runtime.tensorflow.devices import configure_virtual_devices
from keras_tp.runtime.tensorflow.generation import ReplicaGeneration
from keras_tp.runtime.tensorflow.optimizer import ReplicaUpdates
from keras_tp.runtime.tensorflow.optimizer import TensorParallelOptimizer
from keras_tp.runtime.tensorflow.optimizer import tensor_parallel_class
from keras_tp.runtime.tensorflow.regions import ReplicaRegions
from keras_tp.runtime.tensorflow.steps import ReplicaSteps
from keras_tp.runtime.tensorflow.storage import ReplicaShapes
from keras_tp.runtime.tensorflow.storage import ReplicaStorage
from keras_tp.runtime.tensorflow.worker_rows import WorkerRows

__all__ = [
    "RUNTIME",
    "TensorFlowRuntime",
    "TensorParallelOptimizer",
    "configure_multi_worker",
    "configure_virtual_devices",
    "tensor_parallel_class",
]


class TensorFlowRuntime(
    ReplicaDevices,
    ReplicaStorage,
    ReplicaSteps,
    WorkerRows,
    ReplicaUpdates,
    ReplicaRegions,
    ReplicaGeneration,
    MeshRuntime,
):
    """Runs tensor parallelism, DDP and ZeRO on `tf.distribute` replicas.

    The replica with id `d * T + m` is model rank `m` of data-parallel row
    `d` (`T` is the tensor-parallel size): it owns shard `m` of every split
    variable and, under ZeRO, partition `d` of that shard.
    """

    backend = "tensorflow"
    stores_blocks = True
    # The replicas run under tf.distribute, which XLA cannot compile as one
    # program (see `run_step`).
    jit_compile_default = False

    def _build(self):
        self._local_shapes = ReplicaShapes(self.placement)
        # `{key: variable}`: what an optimizer keyed each variable by
        # before it was placed (`ReplicaStorage._store`).
        self.former_keys = {}
        self._build_strategy()


RUNTIME = TensorFlowRuntime
