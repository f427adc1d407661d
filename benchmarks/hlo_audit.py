"""The collectives of each zoo family's compiled JAX step against the count.

On JAX without a data axis the code between split layers runs on global
arrays, where XLA moves whatever a split needs that the plan did not
provide, in collectives `communication_stats()` never sees. This audit
compiles each family's training step at TP=2 (`tests/zoo.py`: tiny
configs, random weights, offline) and lists what the compiled HLO holds
beside what keras_tp counted:

    KERAS_BACKEND=jax python benchmarks/hlo_audit.py rwkv7 qwen3_5 fnet

XLA combines independent collectives into one op of several operands,
so the tensors are compared, not the ops: a kind of collective that moves
more tensors in the HLO than calls counted (or none counted) is marked
`UNCOUNTED`. (XLA may also drop a counted collective whose result
computes twice, so fewer tensors than calls is no finding.)
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(2)

import keras  # noqa: E402

from benchmarks import jax_steps  # noqa: E402


def audit(name):
    """`{kind: (calls counted, tensors in the compiled HLO)}` of zoo
    `name`."""
    from tests import zoo

    model, x, y = zoo.ZOO[name]()
    tp = keras_tp.TensorParallelKeras(model, world_size=2)
    tp.compile(optimizer=keras.optimizers.SGD(1e-2), loss=zoo.loss_for(name))
    tp.train_on_batch(x, y)
    counted = tp.communication_stats()
    compiled = jax_steps.compiled_train_step(tp, x, y)
    result = {}
    for kind, found in jax_steps.hlo_collectives(compiled).items():
        calls = counted.get(kind.replace("-", "_"), {}).get("calls", 0)
        if calls or found["tensors"]:
            result[kind] = (calls, found["tensors"])
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", help="families of tests/zoo.py")
    args = parser.parse_args(argv)
    print("| family | collective: counted calls / compiled tensors |")
    print("|---|---|")
    for name in args.names:
        cells = [
            f"{kind} {calls} / {tensors}"
            + (" UNCOUNTED" if tensors > calls else "")
            for kind, (calls, tensors) in audit(name).items()
        ]
        print(f"| {name} | {'; '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
