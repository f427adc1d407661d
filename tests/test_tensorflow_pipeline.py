"""`TensorParallelKeras(pipeline_parallel=P)` on TensorFlow, logical CPUs.

Run alone:
`KERAS_BACKEND=tensorflow python -m pytest tests/test_tensorflow_pipeline.py`.
Each stage's variables and Adam slots are `tf.Variable`s on the stage's
device; Keras' traced steps run the micro-batches through the stages,
each under its device, next to the same model on one device.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from keras_tp.runtime.tensorflow.devices import device_name  # noqa: E402
from tests import models  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests.pipeline_cases import MICROBATCHES  # noqa: E402

DEVICES = ["cpu:0", "cpu:1"]


def _pipelined(model, **kwargs):
    return keras_tp.TensorParallelKeras(
        model, world_size=2, pipeline_parallel=2, **kwargs
    )


def _device(variable):
    """The device TensorFlow stores a Keras variable on, as `cpu:1`."""
    return device_name(variable.value.device)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fit_evaluate_predict_match_one_device(schedule):
    tp = pipeline_cases.check_mlp_pipeline(schedule)
    assert tp._runtime.last_num_microbatches == MICROBATCHES
    # Each device stores its stage's weights, as TensorFlow placed them,
    # and each Adam slot lives with its variable.
    stage_bytes = pipeline_cases.mlp_stage_bytes()
    assert tp.parameter_bytes_per_device() == dict(zip(DEVICES, stage_bytes))
    stage_of = {"up": 0, "down": 1, "head": 1}
    for variable in tp.model.variables:
        stage = stage_of[variable.path.split("/")[0]]
        assert _device(variable) == DEVICES[stage], variable.path
        prefix = variable.path.replace("/", "_")
        slots = [
            v
            for v in tp.optimizer.variables
            if v.name in (f"{prefix}_momentum", f"{prefix}_velocity")
        ]
        assert [_device(v) for v in slots] == [DEVICES[stage]] * 2


def test_a_keras_hub_backbone_carries_its_padding_mask():
    """GPT2's blocks all read the padding mask: stage 0 passes it on, as
    an integer tensor without a gradient."""
    # The pipeline sums each stage's gradients over the micro-batches,
    # densely; Keras would give the one-device oracle's embedding
    # gradient as `IndexedSlices`, which Adam treats row by row.
    optimizer = keras.optimizers.Adam(1e-2)
    apply = optimizer.apply
    optimizer.apply = lambda grads, variables=None: apply(
        [tf.convert_to_tensor(g) for g in grads], variables
    )
    pipeline_cases.check_backbone_pipeline(
        _pipelined(
            models.gpt2_backbone(length=pipeline_cases.LENGTH),
            num_microbatches=MICROBATCHES,
        ),
        optimizer,
    )


def test_refusals_name_the_fix():
    tp = _pipelined(models.mlp())
    with pytest.raises(ValueError, match="jit_compile=False"):
        tp.compile(optimizer="adam", loss=models.loss_fn(), jit_compile=True)
    tp.compile(optimizer="adam", loss=models.loss_fn())
    x, y = models.data_for("mlp", batch=12)
    with pytest.raises(ValueError, match="sample_weight"):
        tp.fit(x, y, sample_weight=np.ones(12), batch_size=12, verbose=0)
    # 12 samples in batches of 8: Keras traces the step for any size.
    with pytest.raises(ValueError, match="drop_remainder=True"):
        tp.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="Pass data_parallel=1"):
        keras_tp.TensorParallelKeras(
            models.mlp(), world_size=4, pipeline_parallel=2, data_parallel=2
        )
