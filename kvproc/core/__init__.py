"""The in-process core: one rank's block pool (paged blocks, bounded slabs, checkpoints), holds, a request's KV and
the page hash chain. No process, socket or tier here: the store drives it (`kvproc.store`)."""
