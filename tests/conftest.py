"""Test-session settings shared by every backend's tests."""

import gc


def pytest_collection_finish(session):
    # Keras calls `gc.collect()` whenever a layer drops a variable
    # (quantization does, for every layer), and each collection walks
    # every object of the imported frameworks: about 0.8 s in a test
    # process. What exists once the test modules are imported lives for
    # the session, so later collections skip it.
    gc.freeze()
