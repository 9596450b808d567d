"""The warning category of hf_ropekv, and the one way the library warns: actionable problems are
:class:`HfRopeKVWarning` (filterable, ``pytest -W error``), attributed to the user's line; logging is for information.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["HfRopeKVWarning", "warn"]


class HfRopeKVWarning(UserWarning):
    """A problem the user can act on: a setting that does less than asked, or a slower or weaker path taken."""


# Frames that are not the user's: hf_ropekv itself, and the libraries that call into it.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_INTERNAL = ("transformers", "torch", "accelerate", "contextlib.py", "functools.py")


def _is_internal(filename: str) -> bool:
    filename = os.path.abspath(filename)
    return filename.startswith(_PACKAGE_DIR + os.sep) or any(part in _INTERNAL for part in filename.split(os.sep)[-4:])


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame outside hf_ropekv, transformers, torch and accelerate."""
    frame, level = sys._getframe(2), 2  # the caller of warn()
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 2


def warn(message: str) -> None:
    """Issue ``message`` as an :class:`HfRopeKVWarning` attributed to the user's code."""
    warnings.warn(message, HfRopeKVWarning, stacklevel=_user_stacklevel())
