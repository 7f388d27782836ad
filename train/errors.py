"""The one-line errors every command prints (the lowest floor, with `settings`: any module may
import it, it imports nothing of the trainer).

* `MissingExtraError`, `require_train_extra`: a package of pyproject's `train` extra is not
  installed; the commands say so in one line naming the pip command.
* `WriteError`: a checkpoint save or a metrics write that failed (disk full, read-only, ...),
  said in one line with the path and the operating system's message (tensorstore reports an
  OS error as text, `[os_error_code=28]`; `describe_write_error` reads it back).
"""

import errno as errno_mod
import importlib.util
import os
import re

# pyproject's `train` extra
TRAIN_EXTRA = ("optax", "orbax.checkpoint", "matplotlib", "grain", "tensorboardX")


class MissingExtraError(ImportError):
    """A package of the `train` extra is not installed."""


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def require_train_extra(missing: str | None = None) -> None:
    """MissingExtraError naming `pip install "relaymoe-jax[train]"` if the extra is missing:
    `missing` (a module of it whose import the caller saw fail), else the first of `TRAIN_EXTRA`
    that is not installed."""
    missing = missing or next((m for m in TRAIN_EXTRA if not _installed(m)), None)
    if missing is not None:
        raise MissingExtraError(
            f"the trainer needs the train extra ({missing} is not "
            f'installed): pip install "relaymoe-jax[train]"'
        )


class WriteError(Exception):
    """Saving a checkpoint or writing the metrics failed (an OS-level error, e.g. disk full)."""


_QUOTED_PATH = re.compile(r'"(/[^"]+)"')
_OS_CODE = re.compile(r"os_error_code='?(\d+)")


def describe_write_error(e: BaseException) -> str:
    """`os_error_text(e)`, else the error's type and first line."""
    text = os_error_text(e)
    if text is not None:
        return text
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def os_error_text(e: BaseException) -> str | None:
    """`<OS message> (ERRNAME): <path>` for an OSError with an errno anywhere in `e`'s cause
    chain, or for a tensorstore error that carries `os_error_code` (its last quoted absolute
    path); None if there is none (not an operating-system error)."""
    seen, err = set(), e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno:
            return (
                f"{err.strerror or os.strerror(err.errno)} "
                f"({errno_mod.errorcode.get(err.errno, err.errno)})"
                + (f": {err.filename}" if err.filename else "")
            )
        text = str(err)
        code = _OS_CODE.search(text)
        if code:
            n = int(code[1])
            paths = _QUOTED_PATH.findall(text)
            return f"{os.strerror(n)} ({errno_mod.errorcode.get(n, n)})" + (
                f": {paths[-1]}" if paths else ""
            )
        err = err.__cause__ or err.__context__
    return None
