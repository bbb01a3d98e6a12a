"""`overlap router`: prefix- and load-aware routing across replicas (`app.py`: the HTTP side; `picker.py`: the
choice and its scores)."""
