"""The one exception type for bad user input (config, CLI, data, checkpoint).

Raise `UserError("what is wrong: the value given; what is allowed / how to fix")`. The CLI entry
point prints it as a single line `gptrain: error: ...` and exits with code 2, no traceback.
Subcommands parse their flags with `ArgParser`, whose errors are UserErrors too (argparse's own
would print a usage block).
"""

import argparse


class UserError(Exception):
    """Bad input from the user. The message is one line naming the problem and the fix."""

    exit_code = 2


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message cut to its first line, for a one-line error (its type if empty)."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


class ArgParser(argparse.ArgumentParser):
    """argparse for a subcommand: a bad or missing flag is a UserError (one line, exit 2)."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}; see {self.prog} --help")
