"""The KV checkpoint store: incremental KV segments, commit records, per-request restore."""
