"""Data parallelism and ZeRO: what the `data` axis of the mesh does.

- `optimizer`: `CoordinatedOptimizer`, which synchronises gradients over
  `data` (DDP, ZeRO-1/2/3) around any Keras optimizer (`wrapping`: the
  Keras side of running an inner optimizer);
- `zero`: how its variables lie over `data` (partitions, buckets) and the
  collectives of DDP and ZeRO;
- `buckets`: the gradient buckets it sends, one collective each;
- the strategies it holds: `accumulation` and `local_sgd` (when the
  replicas synchronise), `compression` (`Compression`: what the buckets'
  collectives send: 16-bit casts, PowerSGD, 1-bit signs) and `overlap`
  (buckets sent during the backward pass);
- `bucket_probe`: `bucket_cap_mb="auto"`; `clipping`: norms across ranks;
- `zero3`: ZeRO-3's parameter gathers around each layer's call;
- `batch_statistics`: BatchNormalization over the global batch (as
  torch's SyncBatchNorm);
- `reports`: optimizer and gradient bytes per device, gradient sharing,
  and the consistency check of the copies (methods of the model).

Tensor parallelism (the `model` axis) lives in `keras_tp.plan` and
`keras_tp.regions`; each backend's storage and steps in `keras_tp.runtime`.
"""

from keras_tp.parallel.compression import Compression
from keras_tp.parallel.optimizer import CoordinatedOptimizer

__all__ = ["Compression", "CoordinatedOptimizer"]
