"""The record of a study: its folder layout, journal, receipts, usage, owner lock and the read
model over them. Imports only `rescue.core`."""
