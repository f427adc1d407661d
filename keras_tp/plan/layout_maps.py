"""Layout maps: the splits a model's authors or the user name by path.

keras-hub ships a `keras.distribution.LayoutMap` for some families (its
backbones' `get_layout_map()`): the planner follows it for the layers it
lists, keeping the Megatron pairing's styles where they split the same
layers. A `LayoutMap` given as the plan decides every layer, and what it
does not split on the `model` axis stays whole, as under Keras'
`ModelParallel`.
"""

import logging

import keras

from keras_tp.plan.attention import ATTENTION
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.styles import Decision
from keras_tp.plan.styles import Replicate

logger = logging.getLogger(__name__)


def model_layout_map(model, tensor_parallel):
    """The `keras.distribution.LayoutMap` the model ships, or `None`.

    keras-hub backbones of some families have a static `get_layout_map`;
    a task model reaches it through its `backbone`.
    """
    owner = model if hasattr(model, "get_layout_map") else None
    if owner is None:
        owner = getattr(model, "backbone", None)
    get_layout_map = getattr(owner, "get_layout_map", None)
    if get_layout_map is None:
        return None
    # The map is only read, never applied: the devices are names.
    mesh = keras.distribution.DeviceMesh(
        shape=(1, tensor_parallel),
        axis_names=("batch", "model"),
        devices=[f"cpu:{i}" for i in range(tensor_parallel)],
    )
    try:
        return get_layout_map(mesh)
    except (TypeError, ValueError) as error:
        logger.info("The layout map of %s is not usable: %s", owner, error)
        return None


def _model_axis(axes):
    for axis, name in enumerate(axes):
        if name == "model" or (isinstance(name, tuple) and "model" in name):
            return axis
    return None


class LayoutMapRules:
    """The layout-map rules of a `Planner` (which provides `model`,
    `tensor_parallel`, `layout_map`, `reasons`, `_negligible`,
    `_style_of_axis` and `_fallback_style`)."""

    def _apply_layout_map(self, decisions, leaves):
        """The model's own layout map decides the layers it lists.

        keras-hub ships one for some families (`get_layout_map()` on Gemma,
        Llama, Qwen): the model authors' choice of which weights to split
        on the `model` axis. A listed layer is split where the map splits
        it and kept whole where the map does; its style is the Megatron
        pairing's when the planner found one (a GSPMD layout may name
        another axis of the same pair, which GSPMD reconciles with extra
        collectives), else the style of the axis the map names; but a
        layer the model's map would split alone stays whole where its
        weights are negligible (`NEGLIGIBLE_SHARE`).
        """
        layout_map = self.layout_map or model_layout_map(
            self.model, self.tensor_parallel
        )
        if layout_map is None:
            return
        source = "LayoutMap" if self.layout_map else "model layout map"
        for layer in leaves:
            handler = leaf_handler(layer)
            path = handler.primary_variable(layer).path
            layout = layout_map[path]
            if layout is None:
                continue
            axis = _model_axis(layout.axes)
            decision = decisions.get(id(layer))
            if axis is None:
                self.reasons[layer.path] = f"kept whole by the {source}"
                decisions[id(layer)] = Decision(
                    layer, Replicate(), id(layer), source
                )
            elif decision is not None and not isinstance(
                decision.style, Replicate
            ):
                split = handler.split_axes(layer, decision.style)
                axis_note = ""
                if split[handler.primary_role(layer)] != axis:
                    axis_note = " (Megatron axis)"
                decisions[id(layer)] = decision._replace(
                    source=source + axis_note
                )
            else:
                # A LayoutMap given as the plan is followed to the letter.
                style = self._style_of_axis(layer, axis)
                given = self.layout_map is not None
                if style is not None and (given or not self._negligible(layer)):
                    decisions[id(layer)] = Decision(
                        layer, style, id(layer), source
                    )

    def _keep_unlisted_whole(self, decisions, leaves):
        """Under a LayoutMap given as the plan, what it does not split on
        the `model` axis stays whole, as under `ModelParallel` (an
        attention layer by its query projection's entry); the rest of a
        Megatron pair whose member stays whole gathers or slices alone."""
        units = [
            d.layer for d in decisions.values() if ATTENTION.matches(d.layer)
        ]
        broken = set()
        for layer in leaves + units:
            if ATTENTION.matches(layer):
                query = next(iter(ATTENTION.projections(layer).values()))
                variable = leaf_handler(query).primary_variable(query)
            else:
                variable = leaf_handler(layer).primary_variable(layer)
            layout = self.layout_map[variable.path]
            if layout is not None and _model_axis(layout.axes) is not None:
                continue
            if id(layer) in decisions and decisions[id(layer)].paired:
                broken.add(decisions[id(layer)].group)
            decisions[id(layer)] = Decision(
                layer, Replicate(), id(layer), "LayoutMap"
            )
            self.reasons[layer.path] = (
                f"not split on 'model' by the LayoutMap ({variable.path})"
            )
        for key, decision in list(decisions.items()):
            if decision.paired and decision.group in broken:
                style = self._fallback_style(decision.layer, ())
                decisions[key] = Decision(
                    decision.layer,
                    style or Replicate(),
                    key,
                    "LayoutMap (its Megatron pair stays whole)",
                )
