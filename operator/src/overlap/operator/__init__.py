"""The InferenceService operator: kopf handlers (handlers.py), child builders (children.py), spec checks
(spec.py), status (status.py) and the one module that calls the Kubernetes API (kube.py). See docs/operator.md."""
