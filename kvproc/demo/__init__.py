"""`kvproc demo`: the reference engine's workload through kvproc (`single`: one engine, three runs side by side;
`pd`: prefill and decode engines sharing a host tier)."""
