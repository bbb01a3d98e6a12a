"""A Kubernetes API server for the tests: kmock's emulator made to behave like kube-apiserver where the operator,
kubectl and helm rely on it. `server` holds the ApiServer; `admission` (CRD defaulting, schema, CEL), `selectors`
and `watches` hold what it does by concern."""

from tests.support.kube.server import ApiServer

__all__ = ["ApiServer"]
