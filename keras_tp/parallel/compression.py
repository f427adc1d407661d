"""Compression of the gradients a `CoordinatedOptimizer` sends over `data`.

Written once in `keras.ops` and the collective adapter interface, so every
backend runs the same arithmetic:

- `"bf16"`, `"fp16"`: each bucket travels in 16 bits and is cast back;
- `"powersgd"`: rank-r PowerSGD with error feedback and warm-started `Q`
  (Vogels et al. 2019, torch's `powerSGD_hook`);
- `"sign"`: 1-bit scaled signs with error feedback (EF-SignSGD,
  Karimireddy et al. 2019), packed 32 to an int32 word and all-gathered:
  of the momentum where the inner optimizer keeps one (1-bit Adam,
  `signs.py`), else of the gradient.

Only the data axis is compressed: tensor-parallel collectives carry
activations, and ZeRO-3's gradients are reduce-scattered by the backward
pass of its parameter gathers, before the optimizer sees them.
"""

import math

import numpy as np
from keras import ops

from keras_tp.errors import check_count
from keras_tp.parallel.buckets import PLAIN
from keras_tp.parallel.buckets import all_reduce_flat
from keras_tp.parallel.compression_state import WarmUpCodec
from keras_tp.parallel.compression_state import per_model_rank_variable
from keras_tp.parallel.compression_state import per_rank_variable
from keras_tp.parallel.signs import SignCodec

KINDS = ("bf16", "fp16", "powersgd", "sign")
_CAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# Gram-Schmidt's guard against a zero column, as in torch's PowerSGD.
_EPSILON = 1e-8
# PowerSGD's rank and the uncompressed updates before PowerSGD and signs
# start, by default (measured: `docs/guides/communication.md`).
RANK = 2
WARMUP_STEPS = 100


class Compression:
    """How a `CoordinatedOptimizer` compresses gradients over `data`.

    - `"bf16"` and `"fp16"` cast each bucket to 16 bits for its collective
      (DDP's all-reduce, ZeRO-1/2's reduce-scatter) and back: half the
      bytes. fp16 divides by the number of data ranks before the cast and
      sums after, as torch's `fp16_compress_hook` does, so the sum cannot
      overflow where the mean would not; gradients below 6e-8 flush to
      zero in fp16 (bf16 keeps float32's range).
    - `"powersgd"` approximates each gradient matrix (the gradient
      reshaped to `(shape[0], -1)`) by `P Q^T` of rank `rank`: `P = M Q`
      is all-reduced and orthogonalised, `Q = M^T P` all-reduced, and the
      part of `M` the approximation misses is kept and added to the next
      step's gradient (error feedback). `Q` is reused from the previous
      step (warm start); its first value comes from NumPy with `seed`, the
      same on every rank and backend. A matrix is compressed only if that
      sends at least `min_compression_rate` times fewer bytes; vectors
      and small matrices are all-reduced uncompressed in one call.
    - `"sign"` sends one bit per gradient entry: each rank keeps its
      gradient plus its error, sends the signs (32 to an int32 word) and
      one scale per tensor (the mean absolute value), and keeps what the
      scaled signs miss as its next error. Signs and scales are
      all-gathered: every rank receives `data_parallel` times its own
      bytes, which counts in `communication_stats()`. With Adam or AdamW
      after a warm-up, or SGD with momentum, at ZeRO stage 0 and without
      clipping, what travels is each rank's next momentum, and Adam's
      second moment stays as the warm-up left it (DeepSpeed's 1-bit
      Adam; see `keras_tp.parallel.signs`).

    `"powersgd"` and `"sign"` first send `warmup_steps` updates
    uncompressed, as torch's PowerSGD hook (`start_powerSGD_iter`) and
    DeepSpeed's 1-bit Adam (`freeze_step`) do; errors and `Q`s start at
    the switch (see `compression_state.WarmUpCodec`).

    Under ZeRO-1 and 2, `"bf16"` and `"fp16"` reduce-scatter; `"powersgd"`
    and `"sign"` all-reduce (all-gather) their compressed form and each
    rank keeps its partition of the result. Compression does not apply to
    ZeRO-3, whose gradients are reduce-scattered by the backward pass.

    Args:
        kind: `"bf16"`, `"fp16"`, `"powersgd"` or `"sign"`.
        rank: PowerSGD's rank (default 2: torch's 1 ends an MLP regression
            with Adam 25-51% above uncompressed, warm-up or not).
        min_compression_rate: PowerSGD compresses a matrix only if that
            divides its bytes by at least this (default 2, as torch's).
        seed: seed of PowerSGD's first `Q` (default 0).
        warmup_steps: uncompressed updates before `"powersgd"` or
            `"sign"` start (default 100, measured in
            `docs/guides/communication.md`; 0 compresses from the first).

    Example:

    ```python
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.Adam(1e-3),
        compression=keras_tp.Compression("powersgd", rank=2),
    )
    # Or by name, with the defaults: compression="bf16".
    ```
    """

    def __init__(
        self,
        kind,
        rank=None,
        min_compression_rate=None,
        seed=None,
        warmup_steps=None,
    ):
        if kind not in KINDS:
            raise ValueError(
                f"Compression kind must be one of {KINDS}, got {kind!r}."
            )
        _check_options_apply(
            kind,
            {
                "rank": rank,
                "min_compression_rate": min_compression_rate,
                "seed": seed,
                "warmup_steps": warmup_steps,
            },
        )
        rank = RANK if rank is None else rank
        check_count("PowerSGD's rank", rank)
        rate = 2.0 if min_compression_rate is None else min_compression_rate
        if not rate >= 1:
            raise ValueError(
                "PowerSGD's min_compression_rate must be >= 1, got "
                f"{min_compression_rate!r}."
            )
        if warmup_steps is None:
            warmup_steps = 0 if kind in _CAST_DTYPES else WARMUP_STEPS
        check_count("Compression's warmup_steps", warmup_steps, least=0)
        self.kind = kind
        self.rank = rank
        self.min_compression_rate = float(rate)
        self.seed = 0 if seed is None else int(seed)
        self.warmup_steps = warmup_steps

    @classmethod
    def get(cls, identifier):
        """A `Compression` from a kind's name, a config dict, or `None`.

        Args:
            identifier: `None` (no compression), a `Compression`, a kind
                (`"bf16"`, ...) or a dict from `get_config()`.
        """
        if identifier is None or isinstance(identifier, cls):
            return identifier
        if isinstance(identifier, str):
            return cls(identifier)
        if isinstance(identifier, dict):
            return cls(**identifier)
        raise TypeError(
            "compression must be None, a kind name, a dict or a "
            f"keras_tp.Compression, got {type(identifier)}."
        )

    def get_config(self):
        if self.kind in _CAST_DTYPES:
            return {"kind": self.kind}
        if self.kind == "sign":
            return {"kind": self.kind, "warmup_steps": self.warmup_steps}
        return {
            "kind": self.kind,
            "rank": self.rank,
            "min_compression_rate": self.min_compression_rate,
            "seed": self.seed,
            "warmup_steps": self.warmup_steps,
        }

    def __repr__(self):
        options = ", ".join(
            f"{k}={v!r}" for k, v in self.get_config().items() if k != "kind"
        )
        return f"Compression({self.kind!r}{', ' if options else ''}{options})"

    def compresses(self, shape):
        """Whether PowerSGD compresses a gradient of `shape`.

        Args:
            shape: the gradient's shape on one rank.

        Returns:
            `(n, m, rank)` of its matrix if it is compressed, else `None`.
        """
        if len(shape) < 2:
            return None
        n = shape[0]
        m = math.prod(shape[1:])
        rank = min(n, m, self.rank)
        if (n + m) * rank * self.min_compression_rate > n * m:
            return None
        return n, m, rank


def gradient_compression(identifier, zero_stage):
    """The `Compression` of a `CoordinatedOptimizer`, or `None`.

    Args:
        identifier: its `compression` argument (see `Compression.get`).
        zero_stage: its ZeRO stage; stage 3 compresses nothing.
    """
    compression = Compression.get(identifier)
    if compression is not None and zero_stage == 3:
        raise ValueError(
            f"compression={compression.kind!r} does not apply to "
            "zero_stage=3, whose gradients are reduce-scattered by the "
            "backward pass of its parameter gathers. Use zero_stage=2 "
            "to compress gradients, or compression=None with "
            "zero_stage=3."
        )
    return compression


def make_codec(compression, optimizer, placement, variables):
    """The codec of `compression` for `optimizer`'s buckets.

    A codec does the arithmetic of a compression kind behind
    `buckets.PlainCodec`'s interface. It creates the optimizer variables
    the kind keeps (errors, `Q`s), so that checkpoints keep them.

    Args:
        compression: a `Compression`, or `None` for none.
        optimizer: the `CoordinatedOptimizer` being built (owns them).
        placement: the `Placement` that places them.
        variables: its trainable variables.
    """
    if compression is None:
        return PLAIN
    if compression.kind in _CAST_DTYPES:
        return CastCodec(_CAST_DTYPES[compression.kind])
    if compression.kind == "powersgd":
        codec = PowerSGDCodec(compression, optimizer, placement, variables)
    else:
        codec = SignCodec(
            optimizer, placement, variables, compression.warmup_steps
        )
    if compression.warmup_steps == 0:
        return codec
    return WarmUpCodec(codec, compression.warmup_steps, optimizer)


def _check_options_apply(kind, options):
    """Refuses the options given that `kind` has no use for."""
    applying = {"powersgd": tuple(options), "sign": ("warmup_steps",)}
    given = sorted(
        name
        for name, value in options.items()
        if value is not None and name not in applying.get(kind, ())
    )
    if given:
        raise ValueError(
            f"Compression options {given} do not apply to {kind!r} "
            "(warmup_steps applies to 'powersgd' and 'sign', the others "
            "to 'powersgd'); remove them."
        )


class CastCodec:
    """bf16 and fp16: the collective runs in 16 bits.

    Args:
        dtype: the dtype gradients travel in.
    """

    scatters = True
    variables = ()

    def __init__(self, dtype):
        self.dtype = dtype

    def all_reduce(self, bucket, values, adapter):
        def mean(x):
            return self._mean(x, adapter, adapter.all_reduce)

        return all_reduce_flat(values, adapter, bucket.cap_bytes, mean)

    def reduce_scatter(self, rows, adapter):
        return self._mean(rows, adapter, adapter.reduce_scatter)

    def _mean(self, x, adapter, collective):
        # Divided before the cast and summed after: a sum of means cannot
        # overflow fp16 where the mean itself would not.
        low = ops.cast(ops.divide(x, adapter.size()), self.dtype)
        return ops.cast(collective(low), x.dtype)


class PowerSGDCodec:
    """PowerSGD with error feedback and warm-started `Q`.

    Args:
        compression: the `Compression` (rank, rate, seed).
        optimizer: the `CoordinatedOptimizer` that keeps the state.
        placement: the `Placement` of its variables.
        variables: its trainable variables.
    """

    scatters = False

    def __init__(self, compression, optimizer, placement, variables):
        self.matrices = {}
        self.errors = {}
        self.qs = {}
        for variable in variables:
            shape = placement.model_shard_shape(variable)
            matrix = compression.compresses(shape)
            if matrix is None:
                continue
            n, m, rank = matrix
            self.matrices[id(variable)] = (n, m)
            self.errors[id(variable)] = per_rank_variable(
                optimizer, placement, variable, "powersgd_error"
            )
            rng = np.random.default_rng([compression.seed, len(self.qs)])
            start = rng.standard_normal((m, rank))
            self.qs[id(variable)] = per_model_rank_variable(
                optimizer, placement, variable, start, "powersgd_q"
            )

    @property
    def variables(self):
        return list(self.errors.values()) + list(self.qs.values())

    def state_of(self, bucket):
        """The errors and `Q`s `all_reduce(bucket, ...)` assigns."""
        keys = [id(v) for v in bucket.variables if id(v) in self.matrices]
        return [self.errors[k] for k in keys] + [self.qs[k] for k in keys]

    def all_reduce(self, bucket, values, adapter):
        cap = bucket.cap_bytes
        keys = [id(v) for v in bucket.variables]
        out = list(values)
        plain = [i for i, key in enumerate(keys) if key not in self.matrices]
        if plain:
            averaged = all_reduce_flat([values[i] for i in plain], adapter, cap)
            for i, value in zip(plain, averaged):
                out[i] = value
        packed = [i for i, key in enumerate(keys) if key in self.matrices]
        if not packed:
            return out
        matrices = []
        for i in packed:
            error = ops.reshape(self.errors[keys[i]].value, values[i].shape)
            local = ops.add(values[i], error)
            matrices.append(ops.reshape(local, self.matrices[keys[i]]))
        ps = [
            ops.matmul(matrix, self.qs[keys[i]].value)
            for i, matrix in zip(packed, matrices)
        ]
        ps = [_orthogonalised(p) for p in all_reduce_flat(ps, adapter, cap)]
        qs = [ops.matmul(ops.transpose(m), p) for m, p in zip(matrices, ps)]
        qs = all_reduce_flat(qs, adapter, cap)
        for i, matrix, p, q in zip(packed, matrices, ps, qs):
            approximation = ops.matmul(p, ops.transpose(q))
            error = self.errors[keys[i]]
            error.assign(
                ops.reshape(ops.subtract(matrix, approximation), error.shape)
            )
            self.qs[keys[i]].assign(q)
            out[i] = ops.reshape(approximation, values[i].shape)
        return out


def _orthogonalised(p):
    """`p` with orthonormal columns (modified Gram-Schmidt).

    Columns are few (the rank), so a loop of vector operations is cheap
    and gives the same result on every backend, unlike QR's sign choices.
    """
    columns = []
    for i in range(p.shape[1]):
        column = p[:, i]
        for previous in columns:
            column = column - ops.sum(column * previous) * previous
        columns.append(column / (ops.norm(column) + _EPSILON))
    return ops.stack(columns, axis=1)
