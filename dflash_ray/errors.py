"""The one error type the CLI turns into a single line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input or configuration: the message names the file, row or key and what is wrong."""
