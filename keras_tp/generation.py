"""Generation under tensor parallelism: a keras-hub task's own `generate()`.

keras-hub's `CausalLM.generate()` runs the task's `call_with_cache`: one
forward pass over the prompt seeds a key/value cache, then each step feeds
one token and updates the cache. Its attention layers take the cache as a
call argument (`cache`) and return it updated, last. The task makes the
cache whole, with the head count of its config. Where the plan splits the
key/value projections by heads, each rank computes only its heads' keys
and values, so the cache is split the same way: `install_caches` wraps
those layers' `call` so that the cache enters split on its heads axis (on
JAX a global array laid out split over `model`; on torch and TensorFlow a
rank's own slice) and the updated cache leaves so. Each device then holds
1/T of one device's cache. Key/value heads fewer than the ranks stay
whole, as in training, and so does their cache. The task's own
`call_with_cache` splits its cache the same way before its layers read
it, so that a layer handing its slice back unchanged (Qwen3.5's linear
attention) hands back what the split attention layers do.
"""

import inspect
import weakref

import keras

from keras_tp.keras_internals import sublayers
from keras_tp.plan.attention import CACHE_ARGUMENT
from keras_tp.plan.attention import call_argument
from keras_tp.plan.attention import call_arguments
from keras_tp.plan.attention import key_value_cache_axis
from keras_tp.plan.attention import takes_cache
from keras_tp.plan.sharding_plan import ShardedLayer
from keras_tp.plan.sharding_plan import ShardedUnit
from keras_tp.plan.styles import Column
from keras_tp.regions import set_call

# Tasks whose generate function was made before they were wrapped; it is
# made again at their first `TensorParallelKeras.generate()`.
_READY = weakref.WeakSet()
# The task method keras-hub's generation calls once per step.
CACHED_CALL = "call_with_cache"


def cached_attention_layers(model, plan):
    """The layers of `model` that take a key/value cache and whose heads
    the bound `plan` splits.

    Returns:
        `[(layer, projections)]`, `projections` being the layer's split
        sublayers (`ShardedLayer`s), as its region or the plan holds them.
    """
    units = {
        id(entry.layer): list(entry.projections.values())
        for entry in plan.layers
        if isinstance(entry, ShardedUnit)
    }
    leaves = {
        id(entry.layer): entry
        for entry in plan.layers
        if isinstance(entry, ShardedLayer)
    }
    found = []
    for layer in sublayers(model):
        if not takes_cache(layer):
            continue
        projections = units.get(id(layer)) or [
            leaves[id(sub)] for sub in sublayers(layer) if id(sub) in leaves
        ]
        if any(isinstance(p.style, Column) for p in projections):
            found.append((layer, projections))
    return found


def install_caches(model, plan, runtime):
    """Splits the key/value cache of every attention layer whose heads
    `plan` splits, as the module describes.

    Args:
        model: the wrapped model.
        plan: its bound `ShardingPlan`.
        runtime: the `MeshRuntime` running it.
    """
    layers = cached_attention_layers(model, plan)
    for layer, projections in layers:
        set_call(layer, _split_cache_call(layer, projections, runtime))
    call = getattr(model, CACHED_CALL, None)
    if layers and callable(call):
        # A decoder-only task's; an encoder-decoder's caches go by other
        # names and enter their layers whole.
        parameters = list(inspect.signature(call).parameters)
        if CACHE_ARGUMENT in parameters:
            index = parameters.index(CACHE_ARGUMENT)
            split_call = _split_task_cache_call(call, index, layers, runtime)
            object.__setattr__(model, CACHED_CALL, split_call)


def _split_task_cache_call(call, index, layers, runtime):
    """The task's `call_with_cache`, its cache (argument `index`) split
    before its layers read it: keras-hub stacks the layers' caches on
    axis 1, and a layer that hands its slice back unchanged (Qwen3.5's
    linear attention) must hand back what a split attention layer does,
    its rank's heads."""

    def leaf(tensor):
        if tensor is None or len(tensor.shape) < 3:
            return tensor
        shape = tuple(tensor.shape)
        layer_shape = shape[:1] + shape[2:]
        for _, projections in layers:
            axis = key_value_cache_axis(
                projections, layer_shape, runtime.full_shape
            )
            if axis is not None and axis >= 1:
                return runtime.split_on_model(tensor, axis + 1)
        return tensor

    def call_with_split_cache(*args, **kwargs):
        if index < len(args) or CACHE_ARGUMENT in kwargs:
            cache = args[index] if index < len(args) else kwargs[CACHE_ARGUMENT]
            split = keras.tree.map_structure(leaf, cache)
            args, kwargs = _with_cache(index, split, args, kwargs)
        return call(*args, **kwargs)

    return call_with_split_cache


def _split_cache_call(layer, projections, runtime):
    call = layer.call

    def split(cache):
        """`cache` with each tensor split on its heads' axis, if any (a
        layer may take a structure of caches: T5Gemma2's self- and
        cross-attention caches, `None` in training)."""

        def leaf(tensor):
            if tensor is None:
                return None
            axis = key_value_cache_axis(
                projections, tuple(tensor.shape), runtime.full_shape
            )
            if axis is None:
                # Whole, or a rank's own already.
                return tensor
            return runtime.split_on_model(tensor, axis)

        return keras.tree.map_structure(leaf, cache)

    def call_with_split_cache(*args, **kwargs):
        cache = call_argument(layer, CACHE_ARGUMENT, args, kwargs)
        split_cache = split(cache)
        leaves = zip(keras.tree.flatten(cache), keras.tree.flatten(split_cache))
        if all(whole is part for whole, part in leaves):
            # No cache, a whole one that stays whole, or a rank's own.
            return call(*args, **kwargs)
        index = call_arguments(layer).index(CACHE_ARGUMENT)
        args, kwargs = _with_cache(index, split_cache, args, kwargs)
        outputs = call(*args, **kwargs)
        if not _returns_cache(outputs, cache):
            raise ValueError(
                f"Layer '{layer.path}' takes a key/value cache (its call "
                f"argument `{CACHE_ARGUMENT}`) but does not return the "
                "updated cache last, as keras-hub's attention layers do, so "
                "keras_tp cannot keep it split by heads. Generate with the "
                "model on one device, or pass a plan that keeps this "
                "layer's projections whole (keras_tp.Replicate())."
            )
        *rest, new_cache = outputs
        # A global array (JAX) comes back whole-shaped: it stays laid out
        # split; a rank's own slice is its share already.
        return type(outputs)([*rest, split(new_cache)])

    return call_with_split_cache


def _returns_cache(outputs, cache):
    """Whether a layer's `outputs` end with a cache shaped like `cache`."""
    if not isinstance(outputs, (tuple, list)):
        return False
    ranks = [len(t.shape) for t in keras.tree.flatten(cache) if t is not None]
    returned = [
        len(t.shape) for t in keras.tree.flatten(outputs[-1]) if t is not None
    ]
    return ranks == returned


def _with_cache(index, cache, args, kwargs):
    """The call arguments with `cache` in the place of the cache argument,
    the `index`-th parameter."""
    if index < len(args):
        args = args[:index] + (cache,) + args[index + 1 :]
    else:
        kwargs = {**kwargs, CACHE_ARGUMENT: cache}
    return args, kwargs


def generate(model, runtime, inputs, max_length, stop_token_ids, strip_prompt):
    """Runs the wrapped task's own `generate()` on the runtime's ranks.

    See `TensorParallelKeras.generate`. A generate function the task made
    before it was wrapped ran on one device: it is made again once.
    """
    if not callable(getattr(model, "generate", None)):
        raise TypeError(
            f"Model '{model.name}' ({type(model).__name__}) has no "
            "generate(): TensorParallelKeras.generate() runs the wrapped "
            "task's own, so wrap a keras-hub CausalLM (such as "
            "keras_hub.models.GPT2CausalLM) to generate."
        )
    if runtime.pipeline_parallel > 1:
        raise ValueError(
            "generate() is not supported with pipeline_parallel > 1: the "
            "task generates one token at a time through its layers, outside "
            "the pipeline's stage programs. Wrap the model with tensor "
            "parallelism alone (pipeline_parallel=1) to generate."
        )
    if runtime.sequence_parallel:
        raise ValueError(
            "generate() is not supported with sequence_parallel=True: the "
            "task feeds one token at a time, which cannot be split on the "
            "sequence. Wrap the model with sequence_parallel=False to "
            "generate."
        )
    if model not in _READY:
        model.generate_function = None
        _READY.add(model)
    with runtime.generating(model):
        return model.generate(
            inputs,
            max_length=max_length,
            stop_token_ids=stop_token_ids,
            strip_prompt=strip_prompt,
        )


class Generation:
    """`TensorParallelKeras.generate()`: a mixin (see the module)."""

    def generate(
        self,
        inputs,
        max_length=None,
        stop_token_ids="auto",
        strip_prompt=False,
    ):
        """Generates with the wrapped task's own `generate()`, split.

        The task (a keras-hub `CausalLM`) generates as it does on one
        device, with the sampler it was compiled with (`tp.compile(
        sampler=...)` sets it), while its layers run split across the
        devices and each device keeps its heads' part of the key/value
        cache. Greedy sampling gives the tokens of one device.

        Args:
            inputs: the task's `generate()` inputs: strings with a
                preprocessor attached, otherwise a dict of `token_ids`
                and `padding_mask` (or a `tf.data.Dataset` of either).
            max_length: the length to generate to, with a preprocessor;
                without one, the inputs' padded length.
            stop_token_ids: `"auto"` (the tokenizer's end token), `None`
                (generate to `max_length`) or a tuple of token ids.
            strip_prompt: whether to return only the generated part.

        Returns:
            What the task's `generate()` returns: strings, or a dict of
            `token_ids` and `padding_mask` arrays.

        Example:

        ```python
        causal_lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        tp = keras_tp.TensorParallelKeras(causal_lm, world_size=2)
        tp.fit(x, y)
        tp.compile(sampler="greedy")
        tp.generate(prompt, stop_token_ids=None)["token_ids"]
        ```
        """
        return generate(
            self.model,
            self._runtime,
            inputs,
            max_length,
            stop_token_ids,
            strip_prompt,
        )
