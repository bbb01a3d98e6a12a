"""The shared test harness, imported as `tests.support.*`: engine factories and fake runners (`engine`), the sidecar
tests' processes and HTTP helpers (`sidecar`, `fake_engine_server`), and the emulated Kubernetes API (`kube`)."""
