"""The JSON form of the option values JSON has no type for: a tuple, a ``Counter``, a small tensor, each an object
of one key, its tag (``{"$tuple": [0.9, 0.999]}``). ``optim`` writes and reads them (its ``_encode`` and
``_decode``, which build tensors); ``shown`` writes them as a person reads them, for the views, which load no
torch (this module imports nothing)."""

from __future__ import annotations

TUPLE, COUNTER, TENSOR = "$tuple", "$counter", "$tensor"


def tag_of(data) -> tuple[str, object] | None:
    """``(tag, body)`` of a tagged value, None for any other JSON value."""
    if isinstance(data, dict) and len(data) == 1:
        (tag, body), = data.items()
        if tag in (TUPLE, COUNTER, TENSOR):
            return tag, body
    return None


def shown(data) -> str:
    """A JSON option value as the user wrote it in Python: ``(0.9, 0.999)``, ``Counter({3: 1})``,
    ``tensor([0.1, 0.2])``; a string as it is."""
    tagged = tag_of(data)
    if tagged is not None:
        tag, body = tagged
        if tag == TUPLE:
            items = [shown(v) for v in body]
            return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
        if tag == COUNTER:
            return f"Counter({{{', '.join(f'{shown(k)}: {shown(v)}' for k, v in body)}}})"
        return f"tensor({body['data']})" if body["shape"] else f"tensor({body['data'][0]})"
    if isinstance(data, list):
        return f"[{', '.join(shown(v) for v in data)}]"
    if isinstance(data, dict):
        return f"{{{', '.join(f'{k!r}: {shown(v)}' for k, v in data.items())}}}"
    return data if isinstance(data, str) else repr(data)
