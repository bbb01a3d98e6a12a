"""What stands in front of a service's pods: `overlap router` (`router/`: one address for several replicas, each
request sent where its prompt's KV is cached) and `overlap activator` (`activator.py`: holds requests while the
service has no ready replica). Both are a `proxy.HoldingProxy`: requests held in a `waiting.WaitingRoom` until an
upstream is ready, then relayed as they came."""
