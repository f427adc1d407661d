"""Pipeline parallelism: `split_stages` cuts a Functional model into stages
of the user's own layers; `schedules` orders each stage's passes of the
microbatches (GPipe, 1F1B) and simulates them to measure the bubble."""

from keras_tp.pipeline.cutting import split_stages
from keras_tp.pipeline.schedules import Action
from keras_tp.pipeline.schedules import Timeline
from keras_tp.pipeline.schedules import bubble_fraction
from keras_tp.pipeline.schedules import gpipe
from keras_tp.pipeline.schedules import ideal_bubble
from keras_tp.pipeline.schedules import one_f_one_b
from keras_tp.pipeline.schedules import peak_activations
from keras_tp.pipeline.schedules import simulate
from keras_tp.pipeline.stages import Boundary
from keras_tp.pipeline.stages import BoundaryTensor
from keras_tp.pipeline.stages import Stage
from keras_tp.pipeline.stages import StageSplit

__all__ = [
    "Action",
    "Boundary",
    "BoundaryTensor",
    "Stage",
    "StageSplit",
    "Timeline",
    "bubble_fraction",
    "gpipe",
    "ideal_bubble",
    "one_f_one_b",
    "peak_activations",
    "simulate",
    "split_stages",
]
