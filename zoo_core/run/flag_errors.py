"""The wording of the training command's flag mistakes: each parse error of absl or ml_collections (an
unknown --config.a.b override, a bad value, a config file that does not load or raises) as one line that
names the flag, the file and line, or the fields like a mistyped one (`flag_error`), and a --config that
names a directory (`config_path_problem`).
"""
from __future__ import annotations

import difflib
import importlib.util
import os
from typing import Sequence

from absl import flags


def flag_error(e: Exception, argv: Sequence[str]) -> str | None:
    """The one-line message of an exception raised while parsing `argv`, or None when it is not a flag or
    config mistake (then it is re-raised)."""
    if isinstance(e, flags.Error):
        inner = innermost(e)
        if isinstance(inner, UnicodeError):
            # A binary file read as text by the config (e.g. a CSV's header): absl's re-raise of the
            # decode error loses the message ("function takes exactly 5 arguments").
            return (f"bad flag: {first_line(str(e))}: a file the config reads is not UTF-8 text "
                    f"({type(inner).__name__}: {inner}); expected a text file such as a CSV")
        return f"bad flag: {last_line(str(e))}"
    if isinstance(e, OSError):   # a config file that does not load, met while registering its override flags
        return f"bad flag: --config {config_argument(argv)}: {last_line(str(e))}"
    if (where := config_code_error(e, argv)) is not None:
        return f"bad flag: --config {config_argument(argv)}: the config file raised an error at {where}"
    if not isinstance(e, (AttributeError, KeyError, TypeError, ValueError)):
        return None
    # ml_collections reports an unknown --config.a.b override as AttributeError("'b'").
    detail = str(e.args[0] if e.args else e).replace("\\n", "; ").replace("\n", "; ")
    detail = " ".join(detail.replace("\\", "").replace("'", "").replace('"', "").split())
    bad = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
    if "Did you mean" not in detail:
        detail += suggestion(detail, bad, argv)
    return f"invalid config override: {detail or type(e).__name__} (overrides given: {', '.join(bad) or 'none'})"


def config_path_problem(argv: Sequence[str]) -> str | None:
    """The one line for a --config naming a directory, with the config files in it (absl's own answer
    is 'Configuration is not available because of an earlier failure to load: [Errno 21]'); None for
    anything else."""
    given, colon, args = config_argument(argv).partition(":")
    if not given or not os.path.isdir(given):
        return None
    files = sorted(name for name in os.listdir(given) if name.endswith(".py") and _defines_a_config(
        os.path.join(given, name)))
    head = f"bad flag: --config {given} is a directory, not a config file"
    if not files:
        return f"{head} (none in it defines get_config); give a file such as configs/core/synthetic.py:smoke"
    return (f"{head}; give one of its files, e.g. {os.path.join(given, files[0])}{colon}{args} "
            f"({given.rstrip('/')} has: {', '.join(files)})")


def _defines_a_config(path: str) -> bool:
    """Whether the Python file at `path` defines `get_config` (a folder's common.py only helps them)."""
    try:
        with open(path, encoding="utf-8") as f:
            return "\ndef get_config(" in f.read()
    except (OSError, UnicodeError):
        return False


def last_line(message: str) -> str:
    """The line of a multi-line message that names the problem (a traceback's final line)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1 and "Traceback (most recent call last):" in message:
        return f"{lines[0]} {lines[-1]}"     # 'flag --config=F: Error whilst parsing ...' + the exception
    return lines[-1] if lines else ""


def innermost(e: BaseException) -> BaseException:
    """The first exception of the chain (`__cause__` / `__context__`) that led to `e`."""
    seen = {id(e)}
    while (nxt := e.__cause__ or e.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        e = nxt
    return e


def first_line(message: str) -> str:
    """'flag --config=F' of absl's 'flag --config=F: <error>' message."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line.split(": ", 1)[0]


def config_argument(argv: Sequence[str]) -> str:
    """The value of --config in `argv` ('' when absent), for messages about a file that did not load."""
    for i, arg in enumerate(argv):
        if arg in ("--config", "-config") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(("--config=", "-config=")):
            return arg.split("=", 1)[1]
    return ""


def config_code_error(e: BaseException, argv: Sequence[str]) -> str | None:
    """'<file>, line <n>: <Type>: <message>' when `e` was raised by the config file's own code (a bug
    or a syntax error in it, or a file that is not Python), else None."""
    given = config_argument(argv).partition(":")[0]
    path = os.path.abspath(given)
    if isinstance(e, SyntaxError) and e.filename and os.path.abspath(e.filename) == path:
        return f"{e.filename}, line {e.lineno}: SyntaxError: {e.msg}"
    tb, where = e.__traceback__, None
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == path:
            where = tb.tb_lineno
        tb = tb.tb_next
    if where is None:
        return None
    return f"{given}, line {where}: {type(e).__name__}: {e}"


def suggestion(name: str, overrides: Sequence[str], argv: Sequence[str]) -> str:
    """'; fields of config.<parent> like it: a, b' for an unknown override `name` that ml_collections
    found no close match for (it misses e.g. model.dropout -> dropout_rate, attention_dropout)."""
    file, colon, args = config_argument(argv).partition(":")
    try:   # the flag holds no value after a failed parse: load the file again, as ml_collections does
        spec = importlib.util.spec_from_file_location("_zoo_config_for_suggestions", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config(args) if colon else module.get_config()
    except Exception:   # the file itself does not load: nothing to suggest from
        return ""
    for override in overrides:
        keys_given = override[len("--config."):].split(".")
        if name not in keys_given:
            continue
        above = keys_given[:keys_given.index(name)]
        parent = config
        for key in above:
            parent = parent.get(key) if hasattr(parent, "get") else None
        if not hasattr(parent, "keys"):
            return ""
        keys = sorted(parent.keys())
        like = [k for k in keys if name.lower() in k.lower() or k.lower() in name.lower()]
        like += [k for k in difflib.get_close_matches(name, keys, n=3, cutoff=0.6) if k not in like]
        where = ".".join(["config", *above])
        return f"; fields of {where} like it: {', '.join(like)}" if like else f"; {where} has: {', '.join(keys)}"
    return ""
