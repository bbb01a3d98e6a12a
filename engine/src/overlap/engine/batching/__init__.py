"""Batch assembly (docs/design.md, layer 2): the scheduler, the KV block manager and the batching policies."""
