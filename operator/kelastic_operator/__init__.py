"""kelastic's operator and local mode.

``kelastic_operator`` turns ElasticJob manifests into Pods: on Kubernetes through kopf
(the operator), and on one machine through :mod:`kelastic_operator.local` (``kelastic
run job.yaml``), which starts an embedded etcd and runs each Pod's sidecar and trainer as
local processes.
"""
