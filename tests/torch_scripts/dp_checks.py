"""Functions run on every rank by `keras_tp.launch` in tests/test_torch_dp.py.

Each launch trains many DDP and ZeRO configurations, because starting the
processes is the slow part. Each run's oracle is the same model on one
device, trained by the same process on the whole global batch.
"""

import keras
import torch.distributed as dist

import keras_tp
from keras_tp.tensors import nbytes
from tests import dp_cases
from tests import models
from tests.torch_scripts.rank_checks import _all_ranks


def _own(per_device):
    (value,) = per_device.values()
    return value


def run_case(name, world_size, data_parallel, zero_stage, kind, **options):
    """One training run against one device; plain numbers of this rank."""
    reference, tp, ref_history, tp_history = dp_cases.train_pair(
        name, world_size, data_parallel, zero_stage, kind, **options
    )
    info = tp.get_gradient_sharding_info()
    return {
        "case": [name, world_size, data_parallel, zero_stage, kind, options],
        "weights": dp_cases.max_diff(reference.get_weights(), tp.get_weights()),
        "losses": tp_history.history["loss"],
        "reference_losses": ref_history.history["loss"],
        "iterations": int(tp.optimizer.iterations.numpy()),
        "consistency": tp.check_gradient_consistency(),
        "psi": sum(v.numpy().nbytes for v in reference.trainable_variables),
        "parameter_bytes": _own(info["parameter_bytes"]),
        "gradient_bytes": _own(info["gradient_bytes"]),
        "optimizer_bytes": _own(info["optimizer_bytes"]),
        "buckets": len(info["buckets"]),
        "bucket_cap_mb": info["bucket_cap_mb"],
        "sharding_info": info,
        "overlap": info["overlap"],
        "timeline": tp.optimizer.bucket_timeline(),
        "data_stats": tp.communication_stats(axis="data"),
        # Bytes of the kernels a backward pass reads: every Dense kernel
        # but the first layer's, whose input needs no gradient.
        "backward_kernel_bytes": sum(
            nbytes(layer.kernel)
            for layer in reference.layers[2:]
            if isinstance(layer, keras.layers.Dense)
        ),
    }


def cases(configurations):
    """`run_case` for each configuration; every rank's results, by rank."""
    return _all_ranks([run_case(*c[:5], **c[5]) for c in configurations])


def api_checks(configurations, save_path):
    """`cases`, then evaluate, predict, save and the errors of a DP model,
    the gradient buffers of accumulation, and the local SGD runs."""
    result = {"cases": [run_case(*c[:5], **c[5]) for c in configurations]}
    reference, tp, _, _ = dp_cases.train_pair("mlp", 2, 2, 3, "adam")
    x, y = models.data_for("mlp", batch=16, seed=3)
    reference.compile(loss=dp_cases.loss_fn(), metrics=["accuracy"])
    result["evaluate"] = (
        tp.evaluate(x, y, batch_size=8, verbose=0),
        reference.evaluate(x, y, batch_size=8, verbose=0),
    )
    result["predict"] = dp_cases.max_diff(
        [tp.predict(x, batch_size=8, verbose=0)],
        [reference.predict(x, batch_size=8, verbose=0)],
    )
    result["any_sample_count"] = dp_cases.any_sample_count(reference, tp)
    tp.save(save_path)
    result["weights"] = [w.tolist() for w in tp.get_weights()]
    result["shapes_after_save"] = [
        list(v.shape) for v in tp.model.trainable_variables
    ]

    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=2, data_parallel=2
    )
    tp.compile(optimizer="sgd", loss=dp_cases.loss_fn())
    x, y = models.data_for("mlp", batch=6)
    try:
        tp.fit(x, y, batch_size=3, verbose=0)
    except ValueError as e:
        result["batch_error"] = str(e)

    # A replica that drifted is found: rank 1 changes its copy.
    kernel = tp.model.get_layer("head").kernel
    if dist.get_rank() == 1:
        kernel.assign(kernel + 0.5)
    result["drift"] = tp.check_gradient_consistency()

    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=2, data_parallel=2, zero_stage=1
    )
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.SGD(0.1), zero_stage=2
    )
    try:
        tp.compile(optimizer=optimizer, loss=dp_cases.loss_fn())
    except ValueError as e:
        result["stage_error"] = str(e)
    result["lamb_errors"] = [
        dp_cases.lamb_refusal(2, 2, 1),
        dp_cases.lamb_refusal(2, 1, 0),
    ]
    result["constraint_error"] = dp_cases.constraint_refusal(2, 1)
    result["constrained"] = dp_cases.constrained_difference(2, 1)
    result["batchnorm"] = dp_cases.batchnorm_after_two_steps(2, 2, 1)
    result["global_losses"] = dp_cases.global_batch_losses(2, 2)
    result["accumulation_buffers"] = dp_cases.accumulation_buffer_bytes(2)
    result["local_sgd"] = dp_cases.local_sgd_runs()
    result["loss_scale"] = dp_cases.loss_scale_overflow(2, 2)
    result["rank"] = dist.get_rank()
    return _all_ranks(result)
