"""keras_tp: real tensor parallelism for Keras 3."""

from keras_tp import collectives
from keras_tp.launch import launch
from keras_tp.model import TensorParallelKeras
from keras_tp.plan import Column
from keras_tp.plan import Replicate
from keras_tp.plan import Row
from keras_tp.plan import ShardingError
from keras_tp.plan import ShardingPlan
from keras_tp.plan import ShardingStyle
from keras_tp.plan import Vocab
from keras_tp.plan import auto_plan
from keras_tp.runtime import configure_virtual_devices

__version__ = "0.1.0"

__all__ = [
    "Column",
    "Replicate",
    "Row",
    "ShardingError",
    "ShardingPlan",
    "ShardingStyle",
    "TensorParallelKeras",
    "Vocab",
    "auto_plan",
    "collectives",
    "configure_virtual_devices",
    "launch",
]
