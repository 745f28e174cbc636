"""Where in a YAML text something is: the line and column of a syntax error or of a mapping key,
for messages that point the reader at the place to edit (``line 3, column 7: ...``)."""

from __future__ import annotations

import yaml


def yaml_problem(e: Exception) -> str:
    """One line for a YAML error: ``line 3, column 7: expected ',' or ']', but got '<stream end>'``."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def key_mark(text: str, key: tuple):
    """Given YAML text and the mapping keys down to one (``("train", "epochs")``), return the
    position of that key (a yaml Mark: 0-based ``line`` and ``column``), or of the deepest of them
    found; None for no key or a text that does not compose. Of repeated keys the last is taken,
    as ``yaml.safe_load`` keeps the last."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except Exception:  # noqa: BLE001 - only to place a message: no position rather than a second error
        return None
    mark = None
    for part in key:
        if not isinstance(node, yaml.MappingNode):
            break
        found = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)]
        if not found:
            break
        k, node = found[-1]
        mark = k.start_mark
    return mark


def key_position(text: str, key: tuple) -> str:
    """Return ``line L, column C: `` (1-based) for the key of :func:`key_mark`, or "" if not found."""
    mark = key_mark(text, key)
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
