"""Imported by training scripts (see docs/runtime.md). Placeholder until the runtime issue lands."""
