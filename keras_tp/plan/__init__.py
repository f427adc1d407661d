"""Sharding plans: styles, the automatic planner and LayoutMap export."""

from keras_tp.errors import ShardingError
from keras_tp.plan.auto import auto_plan
from keras_tp.plan.sharding_plan import ShardingPlan
from keras_tp.plan.styles import Channelwise
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import ExpertParallel
from keras_tp.plan.styles import Replicate
from keras_tp.plan.styles import Row
from keras_tp.plan.styles import ShardingStyle
from keras_tp.plan.styles import Vocab

__all__ = [
    "Channelwise",
    "Column",
    "ExpertParallel",
    "Replicate",
    "Row",
    "ShardingError",
    "ShardingPlan",
    "ShardingStyle",
    "Vocab",
    "auto_plan",
]
