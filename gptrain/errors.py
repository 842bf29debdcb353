"""The one exception type for bad user input (config, CLI, data, checkpoint).

Raise `UserError("what is wrong: the value given; what is allowed / how to fix")`. The CLI entry
point prints it as a single line `gptrain: error: ...` and exits with code 2, no traceback.
"""


class UserError(Exception):
    """Bad input from the user. The message is one line naming the problem and the fix."""

    exit_code = 2
