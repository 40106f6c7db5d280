"""What a console script says when the extra its package needs is not installed.

``pip install kelastic`` is the worker library alone (stdlib only); the sidecar, the
operator and local mode need an extra each (``kelastic[sidecar]``, ``kelastic[operator]``,
``kelastic[local]``, see ``pyproject.toml``). Their entry points catch the
``ModuleNotFoundError`` of a missing third-party module at the top of ``main()`` and hand
it to :func:`missing_extra`, which prints one line instead of a traceback.
"""

from __future__ import annotations

import sys

#: The exit status of a command whose extra is missing (as for bad configuration).
EXIT_MISSING_EXTRA = 2

_OWN = frozenset({"kelastic", "kelastic_sidecar", "kelastic_operator"})


def missing_extra(prog: str, extra: str, exc: ModuleNotFoundError) -> int:
    """Print ``prog``'s one-line "install kelastic[extra]" message on stderr; return 2.

    Args:
        prog: the command's name, the line's prefix.
        extra: the extra that installs what ``prog`` imports.
        exc: the error of the failed import.

    Raises:
        ModuleNotFoundError: ``exc`` itself when the missing module is kelastic's own (a
            broken install or a bug, not a missing extra) or unnamed.
    """
    name = exc.name or ""
    if not name or name.partition(".")[0] in _OWN:
        raise exc
    print(
        f"{prog}: the '{extra}' extra is not installed (no module named {name!r}): "
        f'pip install "kelastic[{extra}]"',
        file=sys.stderr,
    )
    return EXIT_MISSING_EXTRA
