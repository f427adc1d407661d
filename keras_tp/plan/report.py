"""A bound plan as text: per split variable, its style and local bytes."""

from keras_tp.tensors import nbytes


def split_variable_table(plan, local_shape):
    """The header and one row per variable of every split layer.

    Args:
        plan: a bound `ShardingPlan`.
        local_shape: function giving the shape one rank holds of a
            variable (from the runtime's `Placement`, or from the plan
            alone where no device exists).

    Returns:
        A list of text lines.
    """
    header = (
        f"{'Layer (variable)':48} {'Style':28} {'Source':24} "
        f"{'Local shape':18} {'Bytes/device':>12}"
    )
    lines = [
        f"Tensor-parallel plan, tensor_parallel={plan.tensor_parallel}",
        header,
        "-" * len(header),
    ]
    for entry in plan.leaf_layers():
        primary = entry.handler.primary_role(entry.layer)
        for role, variable in entry.handler.variables(entry.layer).items():
            shape = tuple(local_shape(variable))
            style = repr(entry.style) if role == primary else ""
            source = plan.source_of(entry) if role == primary else ""
            lines.append(
                f"{variable.path:48} {style:28} {source:24} "
                f"{str(shape):18} {nbytes(variable, shape):>12,}"
            )
    return lines


def format_plan(plan, local_shape):
    """The plan as a table, then the layers kept whole and the fallbacks."""
    lines = split_variable_table(plan, local_shape)
    if plan.replicated:
        lines.append("Replicated (whole on every device):")
        for path, reason in plan.replicated.items():
            lines.append(f"  {path}: {reason}")
    if plan.fallbacks:
        lines.append("Fell back from a Column -> Row pairing:")
        for path, reason in plan.fallbacks.items():
            lines.append(f"  {path}: {reason}")
    return "\n".join(lines)
