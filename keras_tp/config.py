"""`ParallelConfig`: how a model is split, checked once, and what runs where.

`SUPPORT` is the support matrix: which combinations each backend runs.
The refusals of the combinations it lacks and the table of the docs
(`support_table()`) are written from it; `TensorParallelKeras.summary()`
and `get_parallelism_info()` report the config (`describe()`).
"""

import dataclasses

import keras

from keras_tp.errors import check_count
from keras_tp.pipeline.schedules import check_schedule_name

# In the order the messages name them: the least restricted first.
BACKENDS = ("tensorflow", "torch", "jax")
ZERO_STAGES = (0, 1, 2, 3)
_BACKEND_NAMES = {"jax": "JAX", "torch": "torch", "tensorflow": "TensorFlow"}


@dataclasses.dataclass(frozen=True)
class Support:
    """Where one feature runs on one backend.

    Attributes:
        replicas: whether it runs with `data_parallel > 1`.
        zero_stages: the ZeRO stages it runs with.
    """

    replicas: bool = True
    zero_stages: tuple = ZERO_STAGES

    def runs(self, config):
        """Whether `config` is within what this support allows."""
        return (
            self.replicas or config.data_parallel == 1
        ) and config.zero_stage in self.zero_stages


# The support matrix: per feature, per backend, where it runs (`None`:
# not on that backend). The reasons are those of the runtimes' designs.
SUPPORT = {
    # ZeRO-2 and 3 keep a partition of each gradient only, so a pipeline
    # would reduce-scatter every micro-batch's gradients: num_microbatches
    # times ZeRO-1's traffic (DeepSpeed's pipelines refuse them too).
    "pipeline_parallel": {
        backend: Support(zero_stages=(0, 1)) for backend in BACKENDS
    },
    "sequence_parallel": {
        # The activations between the regions travel as `SequenceShard`s
        # of each replica's `model` group, whatever the data axis and ZeRO.
        "tensorflow": Support(),
        # The shards between the regions are DTensors of each data row's
        # `model` ranks; a layer called on them reads its whole weights
        # (ZeRO-3's partitions, gathered over `data`) as replicated ones.
        "torch": Support(),
        # The regions' shard_maps take and leave sequence shards of global
        # arrays; in a per-rank step (a data axis or ZeRO) every value is
        # local, and the code between regions would need to know which
        # values are shards.
        "jax": Support(replicas=False, zero_stages=(0,)),
    },
    "sequence_parallel in pipeline stages": {
        # Each stage is a `tf.distribute` runtime of its own, which runs
        # it as above.
        "tensorflow": Support(zero_stages=(0, 1)),
        # Each rank's stage runtime runs it as above; sequence shards cross
        # the cuts as each rank's part.
        "torch": Support(zero_stages=(0, 1)),
        # The stages' programs are the regions' shard_maps on each stage's
        # mesh; with replicas they run per rank (see above).
        "jax": Support(replicas=False, zero_stages=(0, 1)),
    },
}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a model is split: a `data x pipe x model` mesh, and its options.

    It checks the combination once, when made, against what the backend
    runs (`keras_tp.config.SUPPORT`), and refuses what cannot run with
    the fix in the message. `TensorParallelKeras` makes one from its
    arguments (`tp.parallel_config`); make one yourself to check a layout
    before building a model.

    Args:
        world_size: total number of devices, `data_parallel x
            pipeline_parallel x tensor_parallel`; `None` takes as many as
            `device_ids` names, else, for a pipeline, one device per stage
            of each replica, else every device there is.
        device_ids: device names to use, e.g. `["cpu:0", "cpu:1"]`, or a
            `keras.distribution.DeviceMesh`: its last axis is the model
            axis, the one before it (if any) the data axis.
        data_parallel: the size of the data axis: replicas that each
            train on a slice of every batch.
        pipeline_parallel: the number of pipeline stages.
        zero_stage: 0 (DDP), 1 (optimizer state partitioned over the data
            axis), 2 (and gradients) or 3 (and parameters).
        sequence_parallel: whether the activations between split layers
            are split on the sequence axis too.
        schedule: a pipeline's order of forward and backward passes,
            `"1f1b"` or `"gpipe"`.
        num_microbatches: micro-batches per batch of a pipeline; `None`
            chooses per batch.
        pipeline_cuts: names of the layers at which stages 1, 2, ...
            start; `None` cuts automatically.
        backend: the Keras backend it runs on; `None` is the current one.

    Example:

    ```python
    config = keras_tp.ParallelConfig(world_size=8, data_parallel=2,
                                     pipeline_parallel=2, zero_stage=1)
    config.tensor_parallel  # 2
    ```
    """

    world_size: int = None
    device_ids: tuple = None
    data_parallel: int = 1
    pipeline_parallel: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    num_microbatches: int = None
    pipeline_cuts: tuple = None
    backend: str = None

    def __post_init__(self):
        if isinstance(self.device_ids, keras.distribution.DeviceMesh):
            self._take_mesh(self.device_ids)
        # Lists given for these become tuples, so that a config is frozen.
        for name in ("device_ids", "pipeline_cuts"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, tuple(value))
        if self.backend is None:
            object.__setattr__(self, "backend", keras.backend.backend())
        self._check_arguments()
        self._check_sizes()
        self._check_supported()

    @property
    def requested_world_size(self):
        """The number of devices asked for; `None` for all there are."""
        if self.world_size is not None:
            return self.world_size
        if self.device_ids is not None:
            return len(self.device_ids)
        if self.pipeline_parallel > 1:
            return self.pipeline_parallel * self.data_parallel
        return None

    @property
    def tensor_parallel(self):
        """The size of the model axis; `None` until the devices are known."""
        size = self.requested_world_size
        if size is None:
            return None
        return size // (self.data_parallel * self.pipeline_parallel)

    def on_devices(self, devices):
        """This config on the chosen `devices` (a runtime's), checked."""
        return dataclasses.replace(
            self, world_size=len(devices), device_ids=devices
        )

    def stage_config(self, devices):
        """The config of one pipeline stage's runtime: the `data x model`
        mesh of its `devices`."""
        return dataclasses.replace(
            self,
            world_size=len(devices),
            device_ids=devices,
            pipeline_parallel=1,
            num_microbatches=None,
            pipeline_cuts=None,
        )

    def describe(self):
        """One line: the mesh and the options, for summaries."""
        sizes = (
            f"world_size={self.requested_world_size or 'all devices'} = "
            f"data {self.data_parallel} x pipe {self.pipeline_parallel} x "
            f"model {self.tensor_parallel or '?'}"
        )
        options = [f"zero_stage={self.zero_stage}"]
        if self.sequence_parallel:
            options.append("sequence_parallel")
        if self.pipeline_parallel > 1:
            options.append(f"schedule={self.schedule}")
            options.append(
                f"num_microbatches={self.num_microbatches or 'auto'}"
            )
        return f"{sizes}, {', '.join(options)} on {self.backend}"

    def _take_mesh(self, mesh):
        """Reads the sizes and devices of a `DeviceMesh` (`device_ids`)."""
        shape = tuple(mesh.shape)
        data = shape[0] if len(shape) == 2 else 1
        if len(shape) > 2 or self.pipeline_parallel > 1:
            raise ValueError(
                f"device_ids is a DeviceMesh of shape {shape} (axes "
                f"{mesh.axis_names}); keras_tp reads a 1-D mesh as the "
                "model axis and a 2-D one as data x model. For a pipeline, "
                "pass the device names and pipeline_parallel instead."
            )
        if self.data_parallel not in (1, data):
            raise ValueError(
                f"data_parallel={self.data_parallel} but the DeviceMesh's "
                f"data axis ({mesh.axis_names[0]!r}) has {data} devices: "
                "leave data_parallel out, the mesh gives it."
            )
        devices = [str(d) for d in mesh.devices.reshape(-1)]
        if self.world_size not in (None, len(devices)):
            raise ValueError(
                f"world_size={self.world_size} but the DeviceMesh has "
                f"{len(devices)} devices: leave world_size out."
            )
        object.__setattr__(self, "data_parallel", data)
        object.__setattr__(self, "device_ids", devices)

    def _check_arguments(self):
        if keras.distribution.distribution() is not None:
            raise ValueError(
                "A global keras.distribution is set "
                f"({type(keras.distribution.distribution()).__name__}); "
                "keras_tp places every variable itself, and the two would "
                "split the model twice. Unset it (`keras.distribution."
                "set_distribution(None)`) and pass its device_mesh as "
                "TensorParallelKeras(model, device_ids=mesh) to use the same "
                "devices."
            )
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(
                f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}."
            )
        check_count("data_parallel", self.data_parallel)
        check_count("pipeline_parallel", self.pipeline_parallel)
        if self.pipeline_parallel == 1 and (
            self.num_microbatches is not None or self.pipeline_cuts is not None
        ):
            raise ValueError(
                "num_microbatches and pipeline_cuts are arguments of a "
                "pipeline: pass pipeline_parallel > 1 with them."
            )
        if self.num_microbatches is not None:
            check_count(
                "num_microbatches", self.num_microbatches, hint=" or None"
            )
        if self.pipeline_parallel > 1:
            check_schedule_name(self.schedule)

    def _check_sizes(self):
        size = self.requested_world_size
        data, pipe = self.data_parallel, self.pipeline_parallel
        if size is not None and pipe == 1 and size % data:
            raise ValueError(
                f"world_size={size} is not divisible by data_parallel={data}."
            )
        if size is not None and size % (pipe * data):
            raise ValueError(
                f"pipeline_parallel={pipe} with world_size={size} and "
                f"data_parallel={data}: a pipeline runs data_parallel "
                "replicas of its stages, each stage on world_size / "
                "(pipeline_parallel x data_parallel) devices split by tensor "
                "parallelism. Pass a world_size divisible by "
                "pipeline_parallel x data_parallel."
            )
        if pipe > 1 and self.zero_stage and data == 1:
            raise ValueError(
                f"zero_stage={self.zero_stage} with pipeline_parallel={pipe} "
                "and data_parallel=1: ZeRO partitions the optimizer state "
                "over the pipeline's replicas, and there is one. Pass "
                "data_parallel > 1, or zero_stage=0."
            )

    def _check_supported(self):
        if self.pipeline_parallel > 1:
            self._check_pipeline_supported()
        elif self.sequence_parallel and not _runs("sequence_parallel", self):
            raise ValueError(
                "sequence_parallel=True "
                + support_text("sequence_parallel")
                + f" (this configuration: {self.backend}, data_parallel="
                f"{self.data_parallel}, zero_stage={self.zero_stage}). "
                + fixes_text("sequence_parallel")
            )

    def _check_pipeline_supported(self):
        pipeline = SUPPORT["pipeline_parallel"].get(self.backend)
        if pipeline is not None and self.zero_stage not in (
            pipeline.zero_stages
        ):
            raise ValueError(
                f"zero_stage={self.zero_stage} with pipeline_parallel="
                f"{self.pipeline_parallel}: on {self.backend} a pipeline "
                f"takes zero_stage in {pipeline.zero_stages}. ZeRO-2 and 3 "
                "keep only a partition of each gradient, so a pipeline "
                "would reduce-scatter every micro-batch's gradients, "
                "num_microbatches times ZeRO-1's traffic (DeepSpeed's "
                "pipelines refuse them too). Pass zero_stage=1, which "
                "partitions the optimizer state over the replicas, or "
                "zero_stage=0."
            )
        feature = "sequence_parallel in pipeline stages"
        if self.sequence_parallel and not _runs(feature, self):
            raise ValueError(
                f"sequence_parallel=True with pipeline_parallel="
                f"{self.pipeline_parallel} and data_parallel="
                f"{self.data_parallel}: inside pipeline stages, sequence "
                "parallelism "
                + support_text(feature)
                + ". "
                + fixes_text(feature)
            )


def _runs(feature, config):
    support = SUPPORT[feature].get(config.backend)
    return support is not None and support.runs(config)


def _context_stages(feature, backend):
    """The ZeRO stages there are where `feature` runs: a pipeline's own
    inside pipeline stages, else all."""
    if feature == "sequence_parallel in pipeline stages":
        return SUPPORT["pipeline_parallel"][backend].zero_stages
    return ZERO_STAGES


def _conditions(feature, backend):
    """The conditions `feature` runs under on `backend`, in words."""
    support = SUPPORT[feature][backend]
    stages = _context_stages(feature, backend)
    zero = [s for s in stages if s in support.zero_stages]
    conditions = []
    if not support.replicas:
        alone = zero == [0] and len(stages) > 1
        conditions.append(
            "with tensor parallelism alone"
            if alone
            else "without data parallelism"
        )
    elif zero == list(stages) and len(stages) > 2:
        conditions.append("with data parallelism and any ZeRO stage")
    elif len(zero) == 2:
        conditions.append(f"with data parallelism and ZeRO-{zero[1]}")
    else:
        conditions.append(
            "with data parallelism and ZeRO stages " + _and(zero[1:])
        )
    return ", ".join(conditions)


def _fix(feature, backend):
    """What a configuration needs to run `feature` on `backend`."""
    support = SUPPORT[feature][backend]
    name = _BACKEND_NAMES[backend]
    stages = _context_stages(feature, backend)
    zero = [s for s in stages if s in support.zero_stages]
    needs = []
    if not support.replicas:
        needs.append("data_parallel=1")
    if zero != list(stages):
        needs.append(
            "zero_stage=0" if zero == [0] else f"zero_stage at most {zero[-1]}"
        )
    if not needs:
        return f"use {name}"
    if needs == ["data_parallel=1"]:
        return f"data_parallel=1 on {name}"
    return f"{name} with " + " and ".join(needs)


def _backends_of(feature):
    return [b for b in BACKENDS if SUPPORT[feature][b] is not None]


def _argument(feature):
    """The argument of `TensorParallelKeras` that turns `feature` on."""
    return feature.split()[0]


def support_text(feature):
    """Where `feature` runs, in words: "runs on X with ..., for now"."""
    places = [
        f"on {_BACKEND_NAMES[b]} {_conditions(feature, b)}"
        for b in _backends_of(feature)
    ]
    return "runs " + _and(places, ", and ") + ", for now"


def fixes_text(feature):
    """What to pass instead of a configuration that cannot run `feature`."""
    fixes = [f"Pass {_argument(feature)}=False"]
    fixes += [_fix(feature, b) for b in _backends_of(feature)]
    return ", or ".join(fixes) + "."


def support_table():
    """The support matrix as a Markdown table, as the docs show it."""
    names = [_BACKEND_NAMES[b] for b in BACKENDS]
    lines = [
        "| Feature | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for feature, row in SUPPORT.items():
        cells = [
            "no" if row[b] is None else _conditions(feature, b)
            for b in BACKENDS
        ]
        argument = _argument(feature)
        label = f"`{argument}`{feature[len(argument) :]}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _and(items, last=" and "):
    items = [str(item) for item in items]
    if len(items) < 2:
        return "".join(items)
    return ", ".join(items[:-1]) + last + items[-1]
