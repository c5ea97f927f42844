"""Operator tooling: the `tidectl` CLI (`tide.admin.cli`) for the draft registry."""
