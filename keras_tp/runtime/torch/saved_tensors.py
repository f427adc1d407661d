"""What a torch training step keeps for its backward pass.

torch keeps the Python object of a tensor saved for the backward pass
alive, with its attributes, as long as the tensor is saved. Keras sets
attributes on its tensors: a layer that supports masking gives its output
the mask as `_keras_mask`. So an attention's probabilities, saved for its
product with the values, would keep the attention's mask (`batch x
sequence x sequence`) alive until the backward pass, for every block.
A step's saved tensors are therefore kept detached: their data, without
the Python object.
"""

import torch


class DetachedSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors hooks that keep each saved tensor detached.

    Returning the tensor itself would also make a reference cycle where
    an operation saves its own output (a softmax), which then outlives
    the step until the garbage collector runs.

    Example:

    ```python
    with DetachedSavedTensors():
        loss = compute_loss(model(x))
        loss.backward()
    ```
    """

    def __init__(self):
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor):
        return tensor.detach()

    def unpack(self, packed):
        return packed
