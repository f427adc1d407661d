"""Generation on the replicas: a task's cached forward pass in each.

keras-hub's `CausalLM.generate()` runs its sampler's loop over the task's
`call_with_cache`. A replica's collectives cannot run inside a loop traced
in the replica (`merge_call` refuses control flow), so the loop stays
outside and each `call_with_cache` runs on every replica as one replica
step: each replica computes its heads and keeps its own slice of the
key/value cache, which the loop carries as a per-replica value, so a
device holds 1/T of the cache. The logits are whole on every replica (the
LM head gathers them) and the first replica's feed the sampler.
"""

import contextlib

from keras_tp.generation import CACHED_CALL
from keras_tp.regions import forward_pass


class ReplicaGeneration:
    """The `TensorFlowRuntime`'s generation (see the module)."""

    @contextlib.contextmanager
    def generating(self, model):
        """Inside, `model.call_with_cache` runs on every replica.

        A task without one (its layers called otherwise) generates through
        its regions, each a replica step of its own that gathers its
        outputs: exact, with the cache whole on each device.
        """
        call = getattr(model, CACHED_CALL, None)
        if call is None:
            yield
            return
        local = self.strategy.experimental_local_results

        def on_replicas(*args, **kwargs):
            def replica_call(*args, **kwargs):
                with self._local_shapes(model), forward_pass():
                    return call(*args, **kwargs)

            *whole, cache = self.strategy.run(
                replica_call, args=args, kwargs=kwargs
            )
            return (*(local(output)[0] for output in whole), cache)

        # An attribute of the instance, as `set_call` replaces `call`; one
        # the instance had already (a user's wrapper) comes back after.
        previous = vars(model).get(CACHED_CALL)
        object.__setattr__(model, CACHED_CALL, on_replicas)
        try:
            yield
        finally:
            if previous is None:
                object.__delattr__(model, CACHED_CALL)
            else:
                object.__setattr__(model, CACHED_CALL, previous)
