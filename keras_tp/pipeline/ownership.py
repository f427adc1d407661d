"""Which stage of a pipeline owns each weight, and a shared weight's gradient.

A weight belongs to the first stage that uses it: that stage stores it,
with its optimizer slots, and updates it. A weight several stages use (a
tied embedding, which also computes the logits) is read by the later
stages from a copy, and their gradients of it are added to the owner's
before the update, as Megatron-LM all-reduces its word embeddings'
gradients between its first and last stages.
"""


class WeightOwners:
    """The owning stage of every variable of a pipeline's stages.

    Args:
        stage_models: each stage's Keras model, in order.
        model: the model the stages were cut from; every variable of it
            must belong to some stage.

    Attributes:
        stage_of: the owning stage of each variable, by id; optimizer slots
            join their variable's stage when they are made (`adopt`).
        shared_stages: the stages of each variable that several stages
            use, by id, the owner first.

    Raises:
        ValueError: for a variable of `model` that no stage uses.
    """

    def __init__(self, stage_models, model):
        self.stage_models = list(stage_models)
        self.stage_of = {}
        self.shared_stages = {}
        for index, stage in enumerate(self.stage_models):
            for variable in stage.variables:
                key = id(variable)
                if key not in self.stage_of:
                    self.stage_of[key] = index
                    continue
                stages = self.shared_stages.setdefault(
                    key, [self.stage_of[key]]
                )
                if index not in stages:
                    stages.append(index)
        strays = [v.path for v in model.variables if id(v) not in self.stage_of]
        if strays:
            raise ValueError(
                f"Variables {strays} of model '{model.name}' are used by no "
                "layer of its graph, so no pipeline stage holds them. Remove "
                "the layers that own them from the model."
            )

    def adopt(self, variable, reference):
        """Gives `variable` (an optimizer slot) the stage of `reference`.

        Returns:
            That stage's index.
        """
        self.stage_of[id(variable)] = self.stage_of[id(reference)]
        return self.stage_of[id(variable)]

    def owned(self, stage):
        """The trainable variables stage `stage` owns and updates, in its
        model's order."""
        return [
            v
            for v in self.stage_models[stage].trainable_variables
            if self.stage_of[id(v)] == stage
        ]

    def gradient_addends(self, gradients, moved):
        """Each owned variable's gradients to add up for its update.

        Args:
            gradients: per stage, the gradients of its model's trainable
                variables, in that order.
            moved: a function of `(gradient, stage, owner)` returning the
                gradient of a shared weight that `stage` computed, moved
                to (and counted as sent to) the owner's devices.

        Returns:
            Per owning stage, per variable it owns (`owned`), the list of
            its gradients: the owner's first, then the later stages'.
        """
        addends = {}
        for stage, grads in enumerate(gradients):
            variables = self.stage_models[stage].trainable_variables
            for variable, grad in zip(variables, grads):
                owner = self.stage_of[id(variable)]
                if owner != stage:
                    grad = moved(grad, stage, owner)
                addends.setdefault(id(variable), []).append(grad)
        return [
            [addends[id(v)] for v in self.owned(stage)]
            for stage in range(len(self.stage_models))
        ]
