"""Operator tooling: the `tidectl` CLI (`tools.admin.cli`) for the draft registry."""
