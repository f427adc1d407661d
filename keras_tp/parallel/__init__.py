"""Data parallelism and ZeRO: what the `data` axis of the mesh does.

- `optimizer`: `CoordinatedOptimizer`, which synchronises gradients over
  `data` (DDP, ZeRO-1/2/3) around any Keras optimizer;
- `buckets`: the gradient buckets it sends, one collective each;
- `compression`: `Compression`, what those collectives send (16-bit
  casts, PowerSGD, 1-bit signs);
- `zero3`: ZeRO-3's parameter gathers around each layer's call;
- `reports`: optimizer and gradient bytes per device, gradient sharing,
  and the consistency check of the copies (methods of the model).

Tensor parallelism (the `model` axis) lives in `keras_tp.plan` and
`keras_tp.regions`; each backend's storage and steps in `keras_tp.runtime`.
"""

from keras_tp.parallel.compression import Compression
from keras_tp.parallel.optimizer import CoordinatedOptimizer

__all__ = ["Compression", "CoordinatedOptimizer"]
