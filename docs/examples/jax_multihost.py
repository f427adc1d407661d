"""Tensor parallelism across hosts on the JAX backend.

Start one copy per host, with the same arguments except --process-id. To
try it on one CPU machine, start two processes with two virtual CPU devices
each (TP=4 across both):

    python jax_multihost.py --coordinator localhost:12355 \
        --num-processes 2 --process-id 0 --cpu-devices 2 &
    python jax_multihost.py --coordinator localhost:12355 \
        --num-processes 2 --process-id 1 --cpu-devices 2
"""

import argparse
import os

os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402

import keras_tp  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument(
        "--cpu-devices",
        type=int,
        help="virtual CPU devices per process (leave unset on GPU hosts)",
    )
    args = parser.parse_args()

    if args.cpu_devices:
        # CPU collectives across processes go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Must come before anything that starts JAX's backend. Without
    # arguments, it reads them from SLURM, Open MPI or the cloud TPU runtime.
    jax.distributed.initialize(
        args.coordinator, args.num_processes, args.process_id
    )
    if args.cpu_devices:
        # After initialize(): this call starts the backend.
        keras_tp.configure_virtual_devices(args.cpu_devices)

    import keras

    from keras_tp.demo.models import counting_sequences
    from keras_tp.demo.models import transformer_lm

    # Tensor parallelism splits the model, not the batch: every process
    # feeds the same batches.
    x, y = counting_sequences(256)
    tp = keras_tp.TensorParallelKeras(
        transformer_lm(), world_size=jax.device_count()
    )
    tp.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = tp.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    losses = [round(loss, 6) for loss in history.history["loss"]]
    print(
        f"process {jax.process_index()}: losses {losses}, parameter bytes "
        f"on this process's devices {tp.parameter_bytes_per_device()}"
    )


if __name__ == "__main__":
    main()
