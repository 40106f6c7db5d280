"""Ship checks: the Helm chart, metrics, dashboard and alerts, verified with the real tools."""
