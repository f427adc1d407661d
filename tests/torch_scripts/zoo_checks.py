"""Run on every rank by `keras_tp.launch` in tests/test_torch_zoo.py."""

from tests import zoo_cases
from tests.torch_scripts.rank_checks import _all_ranks


def zoo_checks(names, world_size):
    """`zoo_cases.measure` of each model; every rank's results.

    Under `"mixed_bfloat16"` and `"mixed_float16"`,
    `zoo_cases.mixed_precision` of Llama under that policy; under
    `"held_refusal"`, `zoo_cases.refused_split_of_held_weights` of Gemma3n;
    under
    `"separable_cnn"`, `zoo_cases.measure` of the separable network; under
    `"cnns"`, `zoo_cases.cnn_checks` of the keras.applications models.
    """
    results = {name: zoo_cases.measure(name, world_size) for name in names}
    for policy in ("mixed_bfloat16", "mixed_float16"):
        results[policy] = zoo_cases.mixed_precision("llama", world_size, policy)
    results["held_refusal"] = zoo_cases.refused_split_of_held_weights(
        "gemma3n", world_size
    )
    results["separable_cnn"] = zoo_cases.measure("separable_cnn", world_size)
    results["cnns"] = {
        name: zoo_cases.cnn_checks(name, world_size) for name in zoo_cases.CNNS
    }
    return _all_ranks(results)
