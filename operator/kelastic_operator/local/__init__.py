"""Local mode: run an ElasticJob on one machine, no Kubernetes (``kelastic run``)."""
