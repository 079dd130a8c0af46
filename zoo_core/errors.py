"""The trainer's two errors: a configuration mistake (`ConfigError`) and a non-finite step (`NonFiniteError`).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake found before compiling (the CLI prints its one line and exits 2)."""


def config_error(e: Exception) -> ConfigError:
    """A setup exception as a one-line ConfigError (naming its type unless it is the zoo's ValueError)."""
    line = str(e).splitlines()[0] if str(e) else ""
    if type(e) is ValueError and line:
        return ConfigError(line)
    return ConfigError(f"{type(e).__name__}: {line}")


class NonFiniteError(FloatingPointError):
    """The loss or the gradient became NaN or infinite; the run stops without saving that state."""
