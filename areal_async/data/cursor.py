"""DatasetCursor: the training order over a dataset, resumable from a checkpoint.

Order: epoch ``e`` visits every row once, in a permutation drawn by
``random.Random(seed + e)`` (``shuffle=False``: file order every epoch). The order is
a pure function of ``(seed, epoch, len(rows))``, so any process rebuilds it.

``next()`` returns ``(epoch, index, row)`` where ``index`` is the row's position in
``rows`` (stable across epochs and restarts: it names the row in events).
``position`` is ``(epoch, offset)``: ``offset`` rows of ``epoch`` have been handed out.
``state_dict()`` saves the position with the seed and dataset size;
``load_state_dict()`` restores it (and refuses a different seed or dataset size,
which would silently change the order), after which ``next()`` continues exactly
where the saved cursor would have. After ``epochs`` passes the cursor is
``exhausted`` and ``next()`` raises StopIteration (``epochs=None``: never).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from areal_async.data.rows import Row


class DatasetCursor:
    """Deterministic, checkpointable epoch order over ``rows``."""

    def __init__(
        self, rows: Sequence[Row], *, seed: int, epochs: int | None = 1, shuffle: bool = True
    ) -> None:
        if not rows:
            raise ValueError("DatasetCursor needs at least one row")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None (endless), got {epochs}")
        self.rows = rows
        self.seed = seed
        self.epochs = epochs
        self.shuffle = shuffle
        self._epoch = 0
        self._offset = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, offset)``: the next row handed out is ``order(epoch)[offset]``."""
        return self._epoch, self._offset

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self._epoch >= self.epochs

    def order(self, epoch: int) -> list[int]:
        """Row indices in the order epoch ``epoch`` visits them."""
        if epoch != self._order_epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next(self) -> tuple[int, int, Row]:
        """The next ``(epoch, index, row)``; StopIteration once ``exhausted``."""
        if self.exhausted:
            raise StopIteration(f"dataset cursor exhausted after {self.epochs} epoch(s)")
        epoch = self._epoch
        index = self.order(epoch)[self._offset]
        self._offset += 1
        if self._offset == len(self.rows):
            self._epoch, self._offset = epoch + 1, 0
        return epoch, index, self.rows[index]

    def __iter__(self) -> Iterator[tuple[int, int, Row]]:
        return self

    def __next__(self) -> tuple[int, int, Row]:
        return self.next()

    def state_dict(self) -> dict[str, Any]:
        """Plain data (msgpack-able) that ``load_state_dict`` turns back into this position."""
        return {"epoch": self._epoch, "offset": self._offset, "seed": self.seed, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; ValueError when it was saved over a different order."""
        if int(state["seed"]) != self.seed or int(state["num_rows"]) != len(self.rows):
            raise ValueError(
                f"cursor state was saved for seed={state['seed']} over {state['num_rows']} rows, but this cursor"
                f" has seed={self.seed} over {len(self.rows)} rows; restoring would change the data order"
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < len(self.rows):
            raise ValueError(f"cursor state has an invalid position (epoch={epoch}, offset={offset})")
        self._epoch, self._offset = epoch, offset
