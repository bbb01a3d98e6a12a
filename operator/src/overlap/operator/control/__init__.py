"""The control loop: load signals from Prometheus (`signals`), the pure scaling and tuning decision (`policy`), and
the kopf timer that reads, decides and acts (`loop`)."""
