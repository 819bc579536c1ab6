"""The error tree drawn in `session_server/errors.py` is the classes as they are."""

from __future__ import annotations

import re

import session_server.errors as errors


def _drawn() -> dict[str, tuple[int | None, str | None, str | None, str | None]]:
    """name -> (status, type, drawn parent, retry_after) from the module docstring's tree."""
    out: dict[str, tuple[int | None, str | None, str | None, str | None]] = {}
    parents: list[str] = []
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"^    ([│ ]*)(?:[├└]── )?([A-Z]\w+)\s+(?:(\d{3}) (\w+))?(.*)$", line)
        if not m:
            continue
        depth = 0 if m.group(2) == "ServiceError" else len(m.group(1)) // 4 + 1
        del parents[depth:]
        retry = re.search(r"Retry-After: (\d+)", m.group(5) or "")
        out[m.group(2)] = (int(m.group(3)) if m.group(3) else None, m.group(4),
                           parents[-1] if parents else None, retry.group(1) if retry else None)
        parents.append(m.group(2))
    return out


def _classes() -> list[type[errors.ServiceError]]:
    return [c for c in vars(errors).values()
            if isinstance(c, type) and issubclass(c, errors.ServiceError)]


def test_error_tree_docstring_is_the_classes() -> None:
    drawn = _drawn()
    classes = _classes()
    assert set(drawn) == {c.__name__ for c in classes}
    for cls in classes:
        status, kind, parent, retry = drawn[cls.__name__]
        if cls is errors.ServiceError:
            continue
        assert (status, kind) == (cls.status, cls.type), cls.__name__
        assert parent == cls.__bases__[0].__name__, cls.__name__
        assert retry == (None if cls.retry_after_s is None else str(cls.retry_after_s)), cls.__name__
