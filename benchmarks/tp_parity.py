"""Parity and memory of tensor parallelism against one device, per model.

Usage: `KERAS_BACKEND=jax python benchmarks/tp_parity.py [--devices 2 4]`
(JAX or TensorFlow, virtual CPU devices). For each test model it prints
the max |difference| to the single-device model of the forward output and
of the weights after 5 Adam steps, and the measured parameter bytes of the
busiest device next to the unsplit bytes.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import keras_tp  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    keras_tp.configure_virtual_devices(max(args.devices))
    import keras
    import numpy as np

    from tests import models

    def max_diff(a, b):
        return max(
            float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
            for x, y in zip(a, b)
        )

    print(
        f"backend={keras.backend.backend()}\n"
        f"{'model':15} {'N':>2} {'forward':>9} {'weights':>9} "
        f"{'bytes/device':>13} {'unsplit':>9} {'ratio':>6}"
    )
    for name, build in models.BUILDERS.items():
        for n in args.devices:
            reference = build()
            tp = keras_tp.TensorParallelKeras(build(), world_size=n)
            x, y = models.data_for(name, batch=20)
            forward = max_diff([reference(x)], [tp(x)])
            for model in (reference, tp):
                model.compile(
                    optimizer=keras.optimizers.Adam(1e-3),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True
                    ),
                )
                model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
            weights = max_diff(reference.get_weights(), tp.get_weights())
            info = tp.get_parallelism_info()
            busiest = max(info["parameter_bytes_per_device"].values())
            total = info["parameter_bytes_total"]
            print(
                f"{name:15} {n:>2} {forward:9.1e} {weights:9.1e} "
                f"{busiest:>13,} {total:>9,} {busiest / total:6.3f}"
            )


if __name__ == "__main__":
    main()
