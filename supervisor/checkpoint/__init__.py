"""The on-disk format: every path, durable writes, the recover store, loading that runs no code."""
