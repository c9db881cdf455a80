"""The one base class of errors caused by what the user gave rlsys (config, data, plug-ins, checkpoints).

`rlsys train` prints these as one clear line and exits with status 2, before any work starts; anything
else is a bug or an infrastructure failure and keeps its traceback.
"""
from __future__ import annotations

import sys
from collections.abc import Callable


class UserInputError(ValueError):
    """Bad input, refused with a message that says what was wrong and where (file, line, field)."""


def exit_status(run: Callable[[], object], prefix: str = "rlsys") -> int:
    """A command's exit status: 0 after ``run()``, or 2 after printing its UserInputError as one line
    (``prefix: message``) on stderr, without a traceback."""
    try:
        run()
    except UserInputError as err:
        print(f"{prefix}: {err}", file=sys.stderr)
        return 2
    return 0
