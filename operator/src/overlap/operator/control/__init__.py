"""The control loop: load signals from Prometheus (`signals`), what the rules read, remember and return (`policy`),
the pure scaling decision (`decide`) with its knob rules (`tuning`) and forecasts (`forecast`), and the kopf timer
that reads, decides and acts (`loop`)."""
