"""The trainer's two errors: a configuration mistake (`ConfigError`) and a non-finite step (`NonFiniteError`).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake found before compiling (the CLI prints its one line and exits 2).

    `command_line`: the message as the training command words it, where it names a remedy that the
    command spells as a flag (`--allow_config_change`) and Python as an argument; else the message.
    """

    def __init__(self, message: str = "", *, command_line: str | None = None):
        super().__init__(message)
        self.command_line = command_line or message


def config_error(e: Exception) -> ConfigError:
    """A setup exception as a one-line ConfigError (naming its type unless it is the zoo's ValueError)."""
    line = str(e).splitlines()[0] if str(e) else ""
    if type(e) is ValueError and line:
        return ConfigError(line)
    return ConfigError(f"{type(e).__name__}: {line}")


class NonFiniteError(FloatingPointError):
    """The loss or the gradient became NaN or infinite; the run stops without saving that state."""
