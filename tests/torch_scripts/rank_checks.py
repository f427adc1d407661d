"""Functions run on every rank by `keras_tp.launch` in tests/test_torch.py.

Starting processes is the slow part on a small CPU machine, so each
function does many checks in one launch and returns plain numbers, which
rank 0 hands back to the test. Each rank also builds the same model unsplit
(same seed) as the one-device oracle.
"""

import gc
import types

import keras
import numpy as np
import torch
import torch.distributed as dist

import keras_tp
from benchmarks.vocab_parallel import torch_step_memory
from keras_tp import collectives
from keras_tp.tensors import nbytes
from tests import generation_cases
from tests import models
from tests import output_cases
from tests import own_loss_cases
from tests import random_cases
from tests import regularizer_cases
from tests import vocab_cases


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=_loss())


def _numpy(x):
    return keras.ops.convert_to_numpy(x)


def _gradients(model, variables, x, y):
    """`(grads of `variables`, grad of a float input or None)`, one batch."""
    for variable in variables:
        variable.value.grad = None
    floating = np.issubdtype(x.dtype, np.floating)
    inputs = torch.tensor(x, requires_grad=floating)
    loss = _loss()(torch.tensor(y), model(inputs))
    loss.backward()
    grads = {v.path: _numpy(v.value.grad) for v in variables}
    return grads, (_numpy(inputs.grad) if floating else None)


def _split_axes(tp):
    """`{variable path: split axis}` of the variables the plan splits."""
    return {p: a for p, (_, a) in tp.sharding_plan.variable_axes().items()}


def _local_part(full, axis, rank, world_size):
    if axis is None:
        return full
    return np.split(full, world_size, axis=axis)[rank]


def _max_diff(a, b):
    return float(np.max(np.abs(_numpy(a) - _numpy(b))))


def _all_ranks(result):
    """Every rank's `result`, in rank order (rank 0 returns it from launch)."""
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


def reachable_tensor_bytes(*roots):
    """Bytes of every torch tensor reachable from `roots`, once per storage.

    Walks the Python object graph (attributes, containers, closures, bound
    methods, and each tensor's `.grad`) without entering modules, classes,
    frames or function globals, so it finds hidden copies anywhere in the
    model, the optimizer and the runtime, not only the tracked variables.
    """
    seen = set()
    storages = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
            continue
        # Frames (of a suspended generator, say) lead to module globals.
        if isinstance(obj, (type, types.ModuleType, types.FrameType)):
            continue
        if isinstance(obj, types.FunctionType):
            cells = obj.__closure__ or ()
            stack.extend(c.cell_contents for c in cells if _filled(c))
            stack.extend(obj.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def _filled(cell):
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _memory_budget(tp, reference, world_size):
    """`sharded bytes / N + replicated bytes` of params, grads and Adam.

    Full sizes come from the unsplit reference model; which variables are
    split comes from the plan. Adam keeps two slots per trainable variable,
    each split like it, plus its iteration count and learning rate.
    """
    split_paths = set(tp.sharding_plan.variable_axes())
    trainable = {v.path for v in reference.trainable_variables}
    sharded = replicated = 0
    for variable in reference.variables:
        copies = 4 if variable.path in trainable else 1  # value, grad, m, v
        size = copies * nbytes(variable)
        if variable.path in split_paths:
            sharded += size
        else:
            replicated += size
    optimizer = tp.optimizer
    for scalar in (optimizer.iterations, optimizer._learning_rate):
        replicated += nbytes(scalar)
    return sharded / world_size + replicated, sharded, replicated


def model_checks(name, steps=5, batch=4):
    """Forward, gradients, Adam steps, collectives and memory for one model.

    Returns, from rank 0, a list with one dict per rank.
    """
    tp_model = models.BUILDERS[name]()
    reference = models.BUILDERS[name]()
    x, y = models.data_for(name, batch=steps * batch)
    tp = keras_tp.TensorParallelKeras(tp_model, world_size=2)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    axes = _split_axes(tp)
    result = {"rank": rank}

    result["forward"] = _max_diff(tp(x), reference(x))
    result["forward_call_stats"] = tp.communication_stats("call")

    grads, input_grad = _gradients(tp, tp_model.trainable_variables, x, y)
    ref_grads, ref_input_grad = _gradients(
        reference, reference.trainable_variables, x, y
    )
    diffs, ratios = {}, {}
    for path, grad in grads.items():
        full = ref_grads[path]
        expected = _local_part(full, axes.get(path), rank, world_size)
        diffs[path] = _max_diff(grad, expected)
        norm = np.linalg.norm(expected)
        if norm > 1e-6:
            ratios[path] = float(np.linalg.norm(grad) / norm)
    result["gradient"] = max(diffs.values())
    result["gradient_norm_ratios"] = ratios
    if input_grad is not None:
        result["input_gradient"] = _max_diff(input_grad, ref_input_grad)
        result["input_gradient_ratio"] = float(
            np.linalg.norm(input_grad) / np.linalg.norm(ref_input_grad)
        )

    _compile(tp)
    _compile(reference)
    fit = dict(batch_size=batch, epochs=1, shuffle=False, verbose=0)
    result["losses"] = tp.fit(x, y, **fit).history["loss"]
    result["reference_losses"] = reference.fit(x, y, **fit).history["loss"]
    result["steps"] = int(tp.optimizer.iterations.numpy())
    result["weights"] = max(
        _max_diff(a, b)
        for a, b in zip(tp.get_weights(), reference.get_weights())
    )
    result["train_stats"] = tp.communication_stats("train")
    result["train_stats_again"] = (
        tp.train_on_batch(x[:batch], y[:batch]),
        tp.communication_stats("train"),
    )[1]

    budget, sharded, replicated = _memory_budget(tp, reference, world_size)
    result["memory"] = {
        "measured": reachable_tensor_bytes(tp, tp.optimizer),
        "budget": budget,
        "sharded": sharded,
        "replicated": replicated,
        "parameter_bytes": tp.parameter_bytes_per_device(),
        "optimizer_bytes": tp.optimizer_bytes_per_device(),
        "local_variable_bytes": sum(nbytes(v) for v in tp_model.variables),
        "split_variables": len(axes),
    }
    return _all_ranks(result)


def api_checks(save_path):
    """Weights round trips, saving, collectives and error messages."""
    tp_model = models.transformer_lm()
    reference = models.transformer_lm()
    x, _ = models.data_for("transformer_lm")
    tp = keras_tp.TensorParallelKeras(tp_model, world_size=2)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank}

    full = tp.get_weights()
    result["get_weights"] = max(
        _max_diff(a, b) for a, b in zip(full, reference.get_weights())
    )
    result["get_weights_shapes_match"] = [w.shape for w in full] == [
        tuple(v.shape) for v in reference.weights
    ]
    rng = np.random.default_rng(7)
    new_weights = [
        w + rng.normal(0, 0.1, w.shape).astype(w.dtype) for w in full
    ]
    # A failure here is reported, not raised, so the checks after it still
    # run (with the original weights on both models).
    try:
        tp.set_weights(new_weights)
    except ValueError as e:
        result["set_weights_error"] = str(e)
    else:
        reference.set_weights(new_weights)
        result["set_get_weights"] = max(
            _max_diff(a, b) for a, b in zip(tp.get_weights(), new_weights)
        )
    result["set_weights_forward"] = _max_diff(tp(x), reference(x))
    axes = _split_axes(tp)
    result["local_shapes_after_set"] = all(
        v.shape
        == _local_part(
            np.zeros(r.shape), axes.get(v.path), rank, world_size
        ).shape
        for v, r in zip(tp_model.weights, reference.weights)
    )

    tp.save(save_path)
    predictions = tp.predict(x, verbose=0)  # collectives: on every rank
    if rank == 0:
        loaded = keras.saving.load_model(save_path)
        result["saved_predictions"] = _max_diff(
            loaded.predict(x, verbose=0), predictions
        )
    weights_path = save_path.replace(".keras", ".weights.h5")
    tp.save_weights(weights_path)
    if rank == 0:
        plain = models.transformer_lm(seed=3)
        keras_tp.load_checkpoint(plain, weights_path)
        result["saved_weights"] = max(
            _max_diff(a, b)
            for a, b in zip(plain.get_weights(), reference.get_weights())
        )
    result["shards_after_save"] = tp.parameter_bytes_per_device()
    result["forward_after_save"] = _max_diff(tp(x), reference(x))
    result["reference_predictions"] = _numpy(reference(x))
    result["info"] = {
        k: v
        for k, v in tp.get_parallelism_info().items()
        if k in ("backend", "world_size", "tensor_parallel", "devices")
    }

    masked = keras_tp.TensorParallelKeras(random_cases.probe_model(), 2)
    result["masks"] = random_cases.masked_outputs(masked)

    result["collectives"] = _collective_checks(rank, world_size)
    result["conjugate"] = _conjugate_gradient_checks(rank, world_size)
    try:
        collectives.all_reduce(torch.ones(2, requires_grad=True))
    except ValueError as e:
        result["raw_collective_grad_error"] = str(e)

    try:
        keras_tp.TensorParallelKeras(models.mlp(), world_size=4)
    except ValueError as e:
        result["world_size_error"] = str(e)
    try:
        keras_tp.TensorParallelKeras(
            models.mlp(), world_size=2, plan={"^up/kernel$": keras_tp.Row()}
        )
    except ValueError as e:
        result["row_input_error"] = str(e)
    result["vocab_parallel"] = vocab_cases.runs(world_size)
    result["vocab_memory"] = vocab_cases.step_memory(
        world_size, torch_step_memory
    )
    result["generation"] = generation_cases.runs(world_size)
    result["own_loss"] = own_loss_cases.runs(world_size)
    result["twice_returned"] = [
        output_cases.runs(world_size),
        output_cases.runs(world_size, pipeline_parallel=2),
    ]
    result["regularizers"] = regularizer_cases.runs(world_size)
    return _all_ranks(result)


def _collective_checks(rank, world_size):
    """Raw collectives (the public functions) on known per-rank values."""
    local = torch.arange(4.0).reshape(2, 2) + 10 * rank
    every = [np.arange(4.0).reshape(2, 2) + 10 * r for r in range(world_size)]
    checks = {
        "sum": (collectives.all_reduce(local, "sum"), sum(every)),
        "mean": (
            collectives.all_reduce(local, "mean"),
            sum(every) / world_size,
        ),
        "max": (collectives.all_reduce(local, "max"), np.max(every, axis=0)),
        "min": (collectives.all_reduce(local, "min"), np.min(every, axis=0)),
        "all_gather": (
            collectives.all_gather(local, axis=1),
            np.concatenate(every, axis=1),
        ),
        "reduce_scatter": (
            collectives.reduce_scatter(local, axis=1),
            np.split(sum(every), world_size, axis=1)[rank],
        ),
        "broadcast": (collectives.broadcast(local, root=1), every[1]),
    }
    collectives.barrier()
    diffs = {k: _max_diff(got, want) for k, (got, want) in checks.items()}
    diffs["rank"] = collectives.rank()
    diffs["size"] = collectives.size()
    return diffs


def _conjugate_gradient_checks(rank, world_size):
    """Gradients of the Megatron operators vs. the unsplit math.

    `y = sum_r x * w_r` computed as Column-then-Row: each rank holds
    `w_r`, the replicated `x` enters through `copy_to_parallel`, and
    `reduce_from_parallel` sums the partial products. d(sum y)/dx is
    `sum_r w_r`. `torch.distributed.nn.functional.all_reduce` in place of
    `reduce_from_parallel` gives N times that: the trap this adapter avoids.
    """
    import torch.distributed.nn.functional as dist_nn

    weights = [torch.tensor([1.0 + r, 2.0 - r]) for r in range(world_size)]
    expected = sum(weights).numpy()

    def input_grad(reduce):
        x = torch.tensor([0.5, -1.5], requires_grad=True)
        y = reduce(collectives.copy_to_parallel(x) * weights[rank])
        y.sum().backward()
        return x.grad.numpy()

    ours = input_grad(collectives.reduce_from_parallel)
    naive = input_grad(dist_nn.all_reduce)

    full = torch.arange(6.0).reshape(1, 6)
    x = full.clone().requires_grad_(True)
    scale = torch.arange(6.0) + 1
    gathered = collectives.gather_from_parallel(
        collectives.scatter_to_parallel(x, axis=-1), axis=-1
    )
    (gathered * scale).sum().backward()
    return {
        "copy_reduce": _max_diff(ours, expected),
        "naive_ratio": float(np.linalg.norm(naive) / np.linalg.norm(expected)),
        "scatter_gather_forward": _max_diff(gathered.detach(), full),
        # d/dx of sum(scale * x) is scale, each slice's gradient gathered.
        "scatter_gather_grad": _max_diff(x.grad, scale.reshape(1, 6)),
    }


def raise_on_rank(failing_rank):
    """Raises a ValueError on `failing_rank`; the others wait in a barrier."""
    dist.init_process_group("gloo")
    if dist.get_rank() == failing_rank:
        raise ValueError(f"boom on rank {failing_rank}")
    dist.barrier()


def die_on_rank(failing_rank):
    """Kills `failing_rank`'s process; the others wait in a barrier."""
    import os

    dist.init_process_group("gloo")
    if dist.get_rank() == failing_rank:
        os._exit(3)
    dist.barrier()


def hang_on_rank(hanging_rank):
    """`hanging_rank` sleeps forever; the others return at once."""
    import os
    import time

    if int(os.environ["RANK"]) == hanging_rank:
        while True:
            time.sleep(1)
    return "done"
