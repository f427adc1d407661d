"""`initialize_distributed`: one script, alone or as a rank of a launcher.

Which backend runs decides what joining a job means; each backend's part
lives in its runtime (`keras_tp.runtime.jax.distributed`,
`keras_tp.runtime.torch.devices`).
"""

import keras

from keras_tp import mpi
from keras_tp import runtime


def initialize_distributed():
    """Joins this process to the job `mpirun`, `torchrun` or Ray started.

    One script runs alone (`python train.py`) or as one of many processes
    (`mpirun -n 4 python train.py`); call this right after importing
    keras_tp, before any Keras operation and before
    `configure_virtual_devices`. A process that no launcher started goes on
    alone.

    - **JAX**: under `mpirun` (Open MPI, or MPICH's `mpiexec`), calls
      `jax.distributed.initialize(cluster_detection_method="mpi4py")`, so
      that `jax.devices()` lists the devices of every process and a
      `TensorParallelKeras` mesh spans them. Needs `mpi4py`
      (`pip install "keras_tp[mpi]"`). The coordinator listens on rank
      0's host, on the port `JAX_COORDINATOR_PORT` names if set. In a
      worker of Ray Train's `JaxTrainer` on CPUs, starts
      `jax.distributed` over Ray's workers (on GPUs and TPUs Ray has).
    - **torch**: joins the default process group now, rather than when
      the first `TensorParallelKeras` is made, as a rank of `torchrun`,
      `keras_tp.launch`, Ray's `TorchTrainer` or `mpirun` (whose
      variables become torchrun's: `keras_tp.mpi.torchrun_variables`).
    - **TensorFlow**: its workers find one another through `TF_CONFIG`
      (`MultiWorkerMirroredStrategy`), not through MPI; this refuses to run
      under `mpirun` and does nothing otherwise.

    Example:

    ```python
    import keras_tp

    keras_tp.initialize_distributed()        # alone, or under mpirun
    tp = keras_tp.TensorParallelKeras(
        build_my_keras_model(), world_size=keras_tp.elastic_world_size()
    )
    ```
    """
    backend = keras.backend.backend()
    if backend == "jax":
        from keras_tp.runtime.jax import distributed

        distributed.initialize_distributed()
    elif backend == "torch":
        from keras_tp.runtime.torch.devices import join_process_group

        join_process_group()
    elif backend == "tensorflow":
        rank = mpi.mpi_rank()
        if rank is not None:
            raise NotImplementedError(
                "keras_tp.initialize_distributed() joins the ranks mpirun "
                "started on the JAX and torch backends. TensorFlow's workers "
                "find one another through TF_CONFIG instead: start each "
                "worker with its TF_CONFIG, as docs/guides/tensorflow.md "
                "shows, or run this script on JAX or torch."
            )
    else:
        # Raises, naming the supported backends.
        runtime.backend_module()
