"""The query trace: one chained row per policy query (state, instruction, image and action digests).

Each row's digest chains the one before it, so a trace cannot lose or reorder a row unseen.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.digest import digest_json, digest_text


class TraceRow(BaseModel):
    """One policy query: what the policy saw and what it answered, as digests."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    step: int
    """Env step of the query (0, C, 2C, ...)."""
    state: str
    """sha256 of the simulator's observation at the query, images left out (each array with its dtype and shape)."""
    images: dict[str, str] = Field(default_factory=dict)
    """sha256 of each image the policy received, by observation key; empty when the observation profile has no camera."""
    instruction: str
    """sha256 of the UTF-8 instruction the policy was queried with (from q on, the applied one)."""
    actions: str
    """sha256 of the action chunk that ran: after any rules, cut to C actions (dtype and shape included)."""
    chain: str | None = None
    """sha256 over the previous row's chain and this row's fields (`chain_digest`): the last row's chain covers
    every row of the trace, so an edited row breaks every chain after it. None: a row of a study made before
    rows were chained."""

    def fields_digest(self) -> str:
        """The digest this row adds to the chain: its step and digests, the chain left out."""
        return digest_json(self.model_dump(mode="json", exclude={"chain"}))


def chain_digest(previous: str | None, row: TraceRow) -> str:
    """A trace row's chain: sha256 of the previous row's chain (empty for the first row) and the row's fields."""
    return digest_text(f"{previous or ''}:{row.fields_digest()}")


def chained(rows: list[TraceRow], row: TraceRow) -> TraceRow:
    """`row` with its chain after `rows` (a trace being recorded)."""
    return row.model_copy(update={"chain": chain_digest(rows[-1].chain if rows else None, row)})


def chain_break(rows: list[TraceRow]) -> int | None:
    """The index of the first row whose chain is not its predecessors' and its own, or None when all hold
    (a trace of unchained rows, from an older study, has no break to find)."""
    previous = None
    for i, row in enumerate(rows):
        if row.chain is None:
            return None if i == 0 and all(r.chain is None for r in rows) else i
        if row.chain != chain_digest(previous, row):
            return i
        previous = row.chain
    return None
