"""kelastic vs torch.distributed.elastic benchmarks: ``python -m bench all``."""
