"""keras_tp's benchmark suite: fast and lean, next to the alternatives.

`python -m benchmarks` runs the items of issue #14, each backend in a
process of its own (Keras reads `KERAS_BACKEND` at import), and writes a
JSON record, a Markdown table and plots. Every timing is a ratio of two
things measured in the same run, interleaved. See `benchmarks/suite.py`
for the items and their sizes.

This package imports no backend itself, so that each worker can choose its
own before Keras loads.
"""
