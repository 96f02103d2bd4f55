"""The store that drives the core: the three verbs (resolve, seal, retire) over a rank's pool, a tier and copiers
(`kv_store`, `resolve`, `types`), the P/D hand-off (`handoff`), and how a store is put together
in one process (`build`, `local_tier`) or over kvproc's processes (`cluster`)."""
