"""Request management (DESIGN.md, layer 1): a request's state (`request`) and the queues it waits in (`queue`)."""
