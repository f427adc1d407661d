"""Which stage of a pipeline owns each weight: the first that uses it,
which stores and updates it. Later stages that use it (a tied embedding)
read a copy and add their gradients to the owner's, as Megatron-LM
all-reduces its word embeddings' gradients between its first and last
stages."""

from keras_tp.pipeline.schedules import BACKWARD


class WeightOwners:
    """The owning stage of each variable, by id (`stage_of`; optimizer
    slots join their variable's), and the stages of each variable several
    use, the owner first (`shared_stages`)."""

    def __init__(self, stage_models, model):
        self.stage_models = list(stage_models)
        self.model = model
        self.stage_of, self.shared_stages = {}, {}
        for index, stage in enumerate(self.stage_models):
            for variable in stage.variables:
                key = id(variable)
                owner = self.stage_of.setdefault(key, index)
                if owner != index:
                    stages = self.shared_stages.setdefault(key, [owner])
                    if index not in stages:
                        stages.append(index)

    def adopt(self, variable, reference):
        """Gives `variable` (an optimizer slot) the stages of `reference`;
        returns the owner's index."""
        if id(reference) in self.shared_stages:
            self.shared_stages[id(variable)] = self.shared_stages[id(reference)]
        self.stage_of[id(variable)] = self.stage_of[id(reference)]
        return self.stage_of[id(variable)]

    def check_variables(self):
        """Refuses a variable of the model no stage holds, and a
        regularizer on a weight several stages hold (a tied embedding),
        whose penalty each would add."""
        model = self.model
        strays = [v.path for v in model.variables if id(v) not in self.stage_of]
        if strays:
            raise ValueError(
                f"Variables {strays} of model '{model.name}' are used by no "
                "layer of its graph, so no pipeline stage holds them. Remove "
                "the layers that own them from the model."
            )
        for variable in model.trainable_weights:
            stages = self.shared_stages.get(id(variable))
            if variable.regularizer is not None and stages:
                raise ValueError(
                    f"Weight '{variable.path}' has a regularizer and pipeline "
                    f"stages {stages} all use it (a tied embedding), so each "
                    "would add its penalty. Remove the regularizer (AdamW's "
                    "weight_decay decays it once) or cut the model where one "
                    "stage holds all its calls."
                )

    def holds(self, stage, variable):
        """Whether `stage` uses (and so holds) `variable`."""
        owner = self.stage_of[id(variable)]
        return stage in self.shared_stages.get(id(variable), [owner])

    def owned(self, stage):
        """The trainable variables `stage` owns, in its model's order."""
        return [
            v
            for v in self.stage_models[stage].trainable_variables
            if self.stage_of[id(v)] == stage
        ]

    def owned_gradients(self, gradients, send):
        """Per stage, per variable it owns (`owned`), the sum of each
        stage's `gradients` of it; `send(gradient, owner, BACKWARD)` moves
        a later stage's to the owner's devices (`StagePrimitives.send`)."""
        sums = {}
        for stage, model in enumerate(self.stage_models):
            variables = model.trainable_variables
            for variable, grad in zip(variables, gradients[stage]):
                key = id(variable)
                if self.stage_of[key] != stage:
                    grad = send(grad, self.stage_of[key], BACKWARD)
                sums[key] = sums[key] + grad if key in sums else grad
        return [
            [sums[id(v)] for v in self.owned(s)]
            for s in range(len(self.stage_models))
        ]

    def shared_groups(self):
        """The tuples of stages that share weights, sorted."""
        return sorted(set(map(tuple, self.shared_stages.values())))

    def summed_shared(self, stage, gradient_of, all_reduce):
        """`[(variable, gradient)]` of the weights `stage` shares, in the
        model's order, where a process holds one stage:
        `all_reduce(gradient_of(variable), stages)` sums it over them."""
        return [
            (v, all_reduce(gradient_of(v), tuple(self.shared_stages[id(v)])))
            for v in self.model.trainable_variables
            if stage in self.shared_stages.get(id(v), ())
        ]
