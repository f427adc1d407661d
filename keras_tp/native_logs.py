"""Keeps the C++ log lines of TensorFlow, XLA and absl off stderr."""

import atexit
import os
import re
import sys
import threading

# A line of the C++ logs of TensorFlow, XLA or absl, e.g. "I0000
# 00:00:1795424013.569436   26970 port.cc:153] oneDNN custom operations
# are on. ..."; the first letter is the severity.
_NATIVE_LOG_LINE = re.compile(rb"([IWEF])\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
_NATIVE_SEVERITIES = b"IWEF"
# Lines that come with those INFO lines: absl's notice that it logs before
# it is initialised, and the second line of TensorFlow's CPU feature notice.
_NATIVE_INFO_COMPANIONS = (
    b"WARNING: All log messages before absl::InitializeLog() is called",
    b"To enable the following instructions:",
)
# The C++ libraries write to this file descriptor, whatever sys.stderr is.
_STDERR_FD = 2
# Seconds to wait at exit for the last lines of stderr to be copied.
_STDERR_DRAIN_SECONDS = 2.0


def quiet_native_logs():
    """Keeps the C++ log lines of TensorFlow, XLA and absl off stderr.

    Only the `keras-tp` and demo programs call this, never an import:
    a library must not change its user's environment. TensorFlow writes
    several lines when it loads (oneDNN, CUDA stubs, CPU features), some
    before it reads `TF_CPP_MIN_LOG_LEVEL`, and it loads on every backend
    where it is installed, through `keras.utils.set_random_seed`. So this
    sets `TF_CPP_MIN_LOG_LEVEL` to 3 unless it is set, and routes the
    stderr of this process, which child processes inherit, through a
    thread that drops the log lines below that level. Fatal lines,
    Python's warnings and tracebacks pass unchanged;
    `TF_CPP_MIN_LOG_LEVEL=0` shows every line.
    """
    level = os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # TensorFlow's levels: 1 hides INFO, 2 also WARNING, 3 also ERROR.
    if level not in ("1", "2", "3"):
        return
    hidden = _NATIVE_SEVERITIES[: int(level)]
    try:
        terminal = os.dup(_STDERR_FD)
    except OSError:
        return  # No stderr to filter.
    read_end, write_end = os.pipe()
    os.dup2(write_end, _STDERR_FD)
    os.close(write_end)
    copier = threading.Thread(
        target=_copy_without_native_logs,
        args=(read_end, terminal, hidden),
        name="keras-tp-stderr",
        daemon=True,
    )
    copier.start()
    atexit.register(_restore_stderr, terminal, copier)


def _copy_without_native_logs(read_end, terminal, hidden):
    with open(read_end, "rb") as pipe:
        for line in pipe:
            log = _NATIVE_LOG_LINE.match(line)
            if log:
                if log.group(1) in hidden:
                    continue
            elif line.startswith(_NATIVE_INFO_COMPANIONS) and b"I" in hidden:
                continue
            try:
                os.write(terminal, line)
            except OSError:
                # Whoever read stderr went away (`... 2>&1 | head`): keep
                # draining the pipe, so that no writer blocks on it.
                pass


def _restore_stderr(terminal, copier):
    sys.stderr.flush()
    # Closes this process's end of the pipe: the copier reads to its end
    # once the child processes that inherited the pipe have exited too.
    os.dup2(terminal, _STDERR_FD)
    copier.join(_STDERR_DRAIN_SECONDS)
