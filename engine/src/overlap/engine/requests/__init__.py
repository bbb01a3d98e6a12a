"""Request management (docs/design.md, layer 1): a request's state (`request`) and the queues it waits in (`queue`)."""
