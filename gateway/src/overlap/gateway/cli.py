"""`overlap router` and `overlap activator`: the servers in front of a service's pods."""

from __future__ import annotations


def register(subparsers) -> None:
    from overlap.gateway import activator
    from overlap.gateway.router import app as router

    activator.add_parser(subparsers)
    router.add_parser(subparsers)
