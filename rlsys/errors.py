"""The one base class of errors caused by what the user gave rlsys (config, data, plug-ins, checkpoints).

`rlsys train` prints these as one clear line and exits with status 2, before any work starts; anything
else is a bug or an infrastructure failure and keeps its traceback.
"""


class UserInputError(ValueError):
    """Bad input, refused with a message that says what was wrong and where (file, line, field)."""
