"""Read-only figures an owner reads through from the part that keeps them."""

from __future__ import annotations

from typing import Any


class figure(property):  # lower case: used in a class body like ``property``
    """A read-only attribute of an owner that is a public figure of a part it holds:
    ``parked_bytes = figure("_chunks", "parked_bytes", doc)`` reads ``owner._chunks.parked_bytes``; with
    ``count=True``, how many items the collection there holds.

    The owner names one field of its own (its part, which the owner annotates with the part's class) and one
    public attribute of that part, never a path through the part's insides; ``tests/graphkit/memory/
    test_figures.py`` checks every figure against the part's class, so a rename fails there.
    """

    def __init__(self, part: str, name: str, doc: str, *, count: bool = False) -> None:
        if "." in part or "." in name or name.startswith("_"):
            raise ValueError(f"figure({part!r}, {name!r}): a field of the owner and a public name of that part")
        self.part, self.name = part, name

        def get(obj: Any) -> Any:
            value = getattr(getattr(obj, part), name)
            return len(value) if count else value

        super().__init__(get, doc=doc)
