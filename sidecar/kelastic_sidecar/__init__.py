"""The kelastic sidecar: timer server, rendezvous on etcd, and the worker-group supervisor."""
