"""Generation under tensor parallelism: tokens per second and the cache.

Builds keras-hub's `LlamaCausalLM` (random weights; hidden 256, 4 blocks,
8 query and 8 key/value heads, vocabulary 8,192 by default) and generates
greedily from a batch of prompts to `--max-length`, timed after a warm-up
call (which compiles), in three ways on one backend:

- one device: the task's own `generate()`;
- keras_tp: `TensorParallelKeras(task, world_size=T).generate()`;
- on JAX, `keras.distribution.ModelParallel` with the layout map keras-hub
  writes for Llama (`LlamaBackbone.get_layout_map`): the task's own
  `generate()` under the distribution (XLA's GSPMD partitioner places the
  collectives).

For each it prints the tokens generated per second (the batch's new
tokens over the median of `--repeats` timed calls), whether the tokens
equal one device's, and the bytes of key/value cache one device holds
after the prompt, read from the arrays (JAX shards, a torch rank's tensor,
TensorFlow's per-replica components). On torch the ranks are processes
(`keras_tp.launch`, one core each), and one device is rank 0 alone,
run first while the other ranks sleep.

    python benchmarks/generation.py --backend jax --tensor-parallel 2
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend", default="jax", choices=("jax", "torch", "tensorflow")
    )
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    sys.path.insert(0, ROOT)
    import keras_tp

    if args.backend == "torch":
        # `launch` returns rank 0's rows.
        rows = keras_tp.launch(
            _rank, world_size=args.tensor_parallel, args=(args,), timeout=3600
        )
    else:
        keras_tp.configure_virtual_devices(args.tensor_parallel)
        rows = [_one_device(args), _keras_tp(args)()]
        if args.backend == "jax":
            rows.append(_model_parallel(args))
    one_device = rows[0]
    print(
        f"LlamaCausalLM, hidden {args.hidden}, {args.layers} blocks, "
        f"{args.heads} heads, vocabulary {args.vocab}, batch {args.batch}, "
        f"prompt {args.prompt_length} -> {args.max_length} tokens, greedy, "
        f"{args.backend}, T={args.tensor_parallel}"
    )
    print(
        "| run | tokens/s | x one device | warm-up s | tokens equal | "
        "cache KiB per device |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['name']} | {row['tokens_per_second']:.1f} | "
            f"{row['tokens_per_second'] / one_device['tokens_per_second']:.2f}"
            f" | {row['warm_up']:.1f} | "
            f"{(row['tokens'] == one_device['tokens']).all()} | "
            f"{row['cache_bytes'] / 1024:.0f} |"
        )


def _causal_lm(args):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=args.vocab,
        num_layers=args.layers,
        num_query_heads=args.heads,
        num_key_value_heads=args.heads,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        dropout=0.0,
    )
    task = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    task.compile(sampler="greedy")
    return task


def _prompt(args):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = np.zeros((args.batch, args.max_length), "int32")
    ids[:, : args.prompt_length] = rng.integers(
        1, args.vocab, (args.batch, args.prompt_length)
    )
    mask = np.zeros(ids.shape, bool)
    mask[:, : args.prompt_length] = True
    return {"token_ids": ids, "padding_mask": mask}


def _timed(name, generate, args, cache_bytes):
    """Warm-up call, then the median of the timed calls."""
    from keras import ops

    start = time.perf_counter()
    tokens = generate(_prompt(args), stop_token_ids=None)["token_ids"]
    warm_up = time.perf_counter() - start
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        generate(_prompt(args), stop_token_ids=None)
        seconds.append(time.perf_counter() - start)
    new_tokens = args.batch * (args.max_length - args.prompt_length)
    return {
        "name": name,
        "tokens_per_second": new_tokens / statistics.median(seconds),
        "warm_up": warm_up,
        "tokens": ops.convert_to_numpy(tokens),
        "cache_bytes": cache_bytes,
    }


def _cache_bytes(task, args, generating):
    """Bytes of key/value cache one device holds after the prompt.

    The whole cache has the shape the task makes (`(batch, blocks, 2,
    length, key/value heads, head size)` for Llama); the prompt's forward
    pass fills it, inside `generating` (keras_tp's runtime context).
    """
    from keras import ops

    from tests.generation_cases import bytes_per_device

    head_size = args.hidden // args.heads
    shape = (args.batch, args.layers, 2, args.max_length, args.heads, head_size)
    ids = ops.convert_to_tensor(_prompt(args)["token_ids"])
    with generating:
        _, _, cache = task.call_with_cache(ids, ops.zeros(shape), 0)
    return bytes_per_device(cache)


def _one_device(args):
    import contextlib

    task = _causal_lm(args)
    cache = _cache_bytes(task, args, contextlib.nullcontext())
    return _timed("one device", task.generate, args, cache)


def _keras_tp(args):
    """Wraps the task; returns the function that times its generation."""
    import keras_tp

    task = _causal_lm(args)
    tp = keras_tp.TensorParallelKeras(task, world_size=args.tensor_parallel)
    cache = _cache_bytes(task, args, tp._runtime.generating(task))
    name = f"keras_tp T={args.tensor_parallel}"
    return lambda: _timed(name, tp.generate, args, cache)


def _model_parallel(args):
    import keras
    import keras_hub

    devices = keras.distribution.list_devices()[: args.tensor_parallel]
    mesh = keras.distribution.DeviceMesh(
        (1, args.tensor_parallel), ["batch", "model"], devices=devices
    )
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with distribution.scope():
        task = _causal_lm(args)
        cache = _cache_bytes(task, args, distribution.scope())
        return _timed(
            f"ModelParallel T={args.tensor_parallel}, keras-hub layout map",
            task.generate,
            args,
            cache,
        )


def _rank(args):
    """A torch rank: one device on rank 0 alone (the other ranks sleep in
    a barrier), then keras_tp on every rank.

    A device is a rank's share of the cores: rank 0 keeps its threads for
    the one-device run, since two threads on a loaded 2-core machine ran
    generation 8x slower than one in our runs.
    """
    import torch.distributed as dist

    # Wrapping joins the process group of the ranks `launch` started.
    timed_keras_tp = _keras_tp(args)
    rows = [_one_device(args)] if dist.get_rank() == 0 else []
    dist.barrier()
    rows.append(timed_keras_tp())
    return rows


if __name__ == "__main__":
    main()
