"""Read-only figures an owner reads through from the part that keeps them."""

from __future__ import annotations

import operator
from typing import Any


class figure(property):  # lower case: used in a class body like ``property``
    """A read-only attribute read from ``path`` of the owner: ``parked_bytes = figure("_chunks.parked_bytes", doc)``;
    with ``count=True``, how many items the collection there holds."""

    def __init__(self, path: str, doc: str, *, count: bool = False) -> None:
        read = operator.attrgetter(path)

        def get(obj: Any) -> Any:
            return len(read(obj)) if count else read(obj)

        super().__init__(get, doc=doc)
