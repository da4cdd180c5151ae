"""TensorFlow's own log lines, quiet unless ``--verbose``.

TensorFlow's C++ runtime writes lines that say nothing about the user's job and look like
failures: ``failed call to cuInit`` on a machine without a GPU (an ERROR, although
TensorFlow then uses the CPU as intended), ``Local rendezvous is aborting with status:
CANCELLED`` when a step's input iterator ends, and while it loads, lines about oneDNN,
CUDA drivers and CPU instructions that Abseil prints before its logging is initialised,
whatever ``TF_CPP_MIN_LOG_LEVEL`` says. Each command runs :func:`quiet_tensorflow` after
parsing its arguments and before anything imports TensorFlow:

- ``TF_CPP_MIN_LOG_LEVEL=3`` (only fatal errors) unless the environment sets it already;
- TensorFlow is imported with the process's standard error sent to a temporary file,
  shown only if the import fails;
- Abseil's Python logger shows errors only.

``--verbose`` sets ``TF_CPP_MIN_LOG_LEVEL=0`` and hides nothing. Python exceptions and
towers' own messages are never hidden. Child processes (``towers launch``) inherit the
setting through the environment.
"""

from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["quiet_tensorflow"]

LEVEL = "TF_CPP_MIN_LOG_LEVEL"


def quiet_tensorflow(verbose: bool) -> None:
    """Set TensorFlow's logging for this process and import it (see the module doc)."""
    if verbose:
        os.environ[LEVEL] = "0"
        return
    os.environ.setdefault(LEVEL, "3")
    if os.environ[LEVEL] in ("", "0"):  # the user asked for every line
        return
    _import_without_stderr()
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)


def _import_without_stderr() -> None:
    """``import tensorflow`` with file descriptor 2 sent to a temporary file, which is
    copied to standard error when the import raises (its own diagnosis stays visible)."""
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        except BaseException:
            os.dup2(saved, 2)
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
