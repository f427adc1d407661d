"""Test-session settings shared by every backend's tests."""

import gc
import os


def pytest_configure(config):
    if os.environ.get("KERAS_BACKEND") == "tensorflow":
        import tensorflow as tf

        # The tests' graphs are tiny: Grappler's rewrites of each traced
        # function cost more than they save (the TensorFlow phase takes
        # about 15% less without them). The parity checks compare graphs
        # run alike; the multi-worker scripts, in processes of their own,
        # keep Grappler as users do.
        tf.config.optimizer.set_experimental_options(
            {"disable_meta_optimizer": True}
        )


def pytest_collection_finish(session):
    # Keras calls `gc.collect()` whenever a layer drops a variable
    # (quantization does, for every layer), and each collection walks
    # every object of the imported frameworks: about 0.8 s in a test
    # process. What exists once the test modules are imported lives for
    # the session, so later collections skip it.
    gc.freeze()


def pytest_runtest_teardown(item, nextitem):
    # What outlives a test (JAX keeps every traced program in caches of its
    # own: about 30,000 objects a test) is frozen too, once the test's own
    # garbage is collected: else each full collection walks it all again.
    # Keras' int8 quantization collects once a layer: 37 s of its test's
    # 41 s after 40 other tests, 6 s with this; the JAX zoo's file takes
    # 240 s instead of 258, at the same peak memory.
    gc.collect()
    gc.freeze()
