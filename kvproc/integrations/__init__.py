"""Adapters that make kvproc the KV layer of other serving engines (each imports its engine only when used)."""
