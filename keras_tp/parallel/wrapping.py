"""`WrappingOptimizer`: a Keras optimizer that updates through another one."""

import keras

from keras_tp.keras_internals import own_optimizer_variables


class WrappingOptimizer(keras.optimizers.Optimizer):
    """A Keras optimizer that updates the model through an inner one.

    As Keras' `LossScaleOptimizer` does, it takes its learning rate (and
    schedule) and its step counter from the inner optimizer, and its
    variables are its own followed by those of the optimizers it runs.
    `CoordinatedOptimizer` is one.

    Args:
        optimizer: the inner Keras optimizer.
        name: name of this optimizer.
    """

    def __init__(self, optimizer, name):
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer

    @property
    def wrapped_optimizers(self):
        """The Keras optimizers this one runs: the inner one."""
        return [self.inner_optimizer]

    @property
    def variables(self):
        return own_optimizer_variables(self) + [
            v
            for optimizer in self.wrapped_optimizers
            for v in optimizer.variables
        ]

    def scale_loss(self, loss):
        # As the inner optimizer's `apply` unscales the gradients
        # (`loss_scale_factor`).
        return self.inner_optimizer.scale_loss(loss)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations
